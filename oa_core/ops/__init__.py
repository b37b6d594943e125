"""The primitives under the pipeline and its components: selection, k-means, query geometry, scatter, water-filling,
cluster statistics, re-ranking, dense decode, and where Triton and the C++ helpers come from. They import nothing
above them (``tests/test_architecture.py``)."""
