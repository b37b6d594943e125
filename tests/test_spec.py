from pathlib import Path

import pytest
import torch
import yaml

import oa_core as oa


def test_dict_yaml_and_model_are_equivalent(tmp_path):
    data = {
        "clusterer": {"name": "qgc", "num_clusters": 8},
        "selector": "oracle",
        "budget": {"tokens": 100},
        "tail": "discard",
        "sink": 2,
        "local": 8,
        "gqa": "shared",
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    from_dict, from_yaml = oa.build(data), oa.build(path)
    from_model = oa.build(oa.PipelineSpec.model_validate(data))
    assert from_dict.spec == from_yaml.spec == from_model.spec
    assert from_dict.clusterer.config.num_clusters == 8
    assert from_dict.selector.name == "oracle"


def test_the_resolved_spec_names_every_param_and_builds_the_same_pipeline():
    given = {"clusterer": {"name": "qgc", "num_clusters": 8}, "selector": {"name": "pq", "train": 512}}
    pipe = oa.build(given)
    resolved = pipe.resolved_spec()
    assert pipe.spec.selector.params == {"train": 512}  # the spec keeps what it was given ...
    for kind in ("clusterer", "selector", "allocator"):  # ... the record every param, defaults included
        config = getattr(pipe, kind).config
        assert resolved[kind] == {"name": getattr(pipe, kind).name, "params": config.model_dump(mode="json")}
        assert set(resolved[kind]["params"]) == set(type(config).model_fields)
    assert resolved["selector"]["params"]["train"] == 512 and resolved["clusterer"]["params"]["num_clusters"] == 8
    again = oa.build(resolved)
    assert again.resolved_spec() == resolved and repr(again) == repr(pipe)


def test_defaults_are_the_default_spec():
    pipe = oa.build({})
    assert (pipe.clusterer.name, pipe.selector.name, pipe.allocator.name) == ("qgc", "pq", "errorgate")
    # The code's defaults and the default spec file are one pipeline.
    from_file = oa.build(str(Path(__file__).parents[1] / "specs/openattention.yaml"))
    for part in ("clusterer", "selector", "allocator"):
        assert getattr(pipe, part).config == getattr(from_file, part).config, part
    assert pipe.spec.model_dump(exclude={"clusterer", "selector", "allocator"}) == from_file.spec.model_dump(
        exclude={"clusterer", "selector", "allocator"}
    )
    # auto: flash on CUDA, the torch reference elsewhere, with the reason.
    expected = "flash" if torch.cuda.is_available() else "torch"
    assert pipe.spec.kernel.name == "auto" and pipe.kernel.name == expected
    assert pipe.kernel_note == (
        "auto: flash (runs on cuda)" if expected == "flash" else "auto: torch (flash: no CUDA device)"
    )
    assert pipe.spec.tail == "proxy"


def test_auto_takes_the_highest_priority_kernel_that_runs_here(monkeypatch):
    """The core names no kernel: each says where it runs and with what priority (a plugin's too)."""
    from oa_core.registry import ComponentInfo, default_registry
    from oa_plugins.kernels.reference import TorchKernel

    class Everywhere(TorchKernel):
        name = "everywhere-test"
        priority = 100

    class Nowhere(TorchKernel):
        name = "nowhere-test"
        priority = 1000

        @classmethod
        def unavailable(cls, device):
            return "needs a device that does not exist"

    kernels = default_registry().components["kernel"]
    for cls in (Everywhere, Nowhere):
        monkeypatch.setitem(kernels, cls.name, ComponentInfo("kernel", cls.name, cls, "test", "tests"))
    pipe = oa.build({})
    assert pipe.kernel.name == "everywhere-test"
    assert pipe.kernel_note == "auto: everywhere-test (nowhere-test: needs a device that does not exist)"


@pytest.mark.parametrize(
    "budget, message",
    [
        ({"density": 0.0}, "budget.density"),
        ({"density": 1.5}, "budget.density"),
        ({"tokens": 0}, "budget.tokens"),
        ({"density": 0.1, "tokens": 10}, "exactly one of density or tokens"),
        ({}, "exactly one of density or tokens"),
    ],
)
def test_invalid_budget_names_the_field(budget, message):
    with pytest.raises(oa.SpecError, match=message):
        oa.build({"budget": budget})


def test_unknown_component_lists_the_known_ones():
    with pytest.raises(oa.SpecError, match=r"selector: unknown selector 'nope'; known: .*oracle.*qgs"):
        oa.build({"selector": "nope"})


def test_every_bad_component_is_named_in_one_error():
    with pytest.raises(
        oa.SpecError,
        match=r"^clusterer: unknown clusterer 'nope'; known: kmeans, position, qgc; "
        r"selector: unknown selector 'nada'; .*; kernel\.x: Extra inputs",
    ):
        oa.build({"clusterer": "nope", "selector": "nada", "kernel": {"name": "torch", "x": 1}})


def test_invalid_component_parameter_names_the_field():
    with pytest.raises(oa.SpecError, match=r"clusterer\.num_clusters"):
        oa.build({"clusterer": {"name": "qgc", "num_clusters": 0}})
    with pytest.raises(oa.SpecError, match=r"selector\.bits: Extra inputs are not permitted"):
        oa.build({"selector": {"name": "qgs", "bits": 4}})


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"tail": "drop"}, "tail"),
        ({"sink": -1}, "sink"),
        ({"local": -5}, "local"),
        ({"tail_samples": 2}, "tail_samples"),
        ({"tail_samples": 0}, "tail_samples"),
        ({"gqa": "grouped"}, "gqa"),
        ({"bugdet": {"density": 0.1}}, "bugdet"),
    ],
)
def test_invalid_spec_field_is_named(spec, field):
    with pytest.raises(oa.SpecError, match=rf"^{field}: "):
        oa.build(spec)


def test_spec_error_is_a_value_error():
    assert issubclass(oa.SpecError, ValueError)


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("clusterer: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(oa.SpecError, match="invalid YAML"):
        oa.build(path)


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("sink: 4\nbudget: {tokens: 10\nlocal: 64\n")
    with pytest.raises(oa.SpecError, match=rf"^{path}, line 3, column 6: invalid YAML: expected ',' or '}}'"):
        oa.build(path)


def test_missing_or_non_mapping_yaml(tmp_path):
    with pytest.raises(oa.SpecError, match="spec file not found"):
        oa.build(tmp_path / "absent.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- qgc\n")
    with pytest.raises(oa.SpecError, match="a spec is a YAML mapping"):
        oa.build(path)


def test_a_density_budget_rounds_down():
    """E = ⌊ρ·N⌋, so the density read never exceeds the one asked for; per row for a batch of lengths."""
    budget = oa.PipelineSpec.model_validate({"budget": {"density": 0.03}}).budget
    assert budget.rows(1000) == 30 and budget.rows(1033) == 30 and budget.rows(1034) == 31
    assert budget.rows(torch.tensor([1000, 1033, 1034, 10])).tolist() == [30, 30, 31, 0]


def test_a_kernel_that_computes_only_mean_proxies_refuses_a_second_order_spec(monkeypatch):
    """A kernel says which proxies it computes (``Kernel.proxies``); a spec asking another of it fails when built,
    naming the field — never a silent mean proxy under a second-order spec. A mean spec, or no proxy, builds."""
    from oa_core.registry import default_registry
    from oa_plugins.kernels.reference import TorchKernel

    class MeanOnly(TorchKernel):
        name = "mean-only-test"
        proxies = ("mean",)

    registry = default_registry()
    monkeypatch.setitem(
        registry.components["kernel"],
        MeanOnly.name,
        registry.components["kernel"]["torch"].__class__("kernel", MeanOnly.name, MeanOnly, "<test>", "<test>"),
    )
    with pytest.raises(
        oa.SpecError,
        match=r"^proxy: kernel 'mean-only-test' computes mean proxies, not "
        r"'second-order'; set proxy: mean",
    ):
        oa.build({"kernel": "mean-only-test"})
    assert oa.build({"kernel": "mean-only-test", "proxy": "mean"}).kernel.name == "mean-only-test"
    assert oa.build({"kernel": "mean-only-test", "tail": "discard"}).kernel.name == "mean-only-test"
    with pytest.raises(oa.SpecError, match=r"proxy: Input should be 'second-order' or 'mean'"):
        oa.build({"proxy": "exact"})
