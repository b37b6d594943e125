"""benchmarks/studies/generate_profile.py's summary of profiler events: the device's busy time per step, the attention
kernels per layer, and the host's phases (the profiler itself runs on the H200; here, events as it reports them)."""

from types import SimpleNamespace

from conftest import load_benchmark


def kernel(name, us):
    return SimpleNamespace(
        device_type=SimpleNamespace(name="CUDA"), name=name, device_time_total=us, cpu_time_total=0.0
    )


def host(name, us):
    return SimpleNamespace(device_type=SimpleNamespace(name="CPU"), name=name, device_time_total=0.0, cpu_time_total=us)


def test_the_summary_per_step_and_per_layer():
    bench = load_benchmark("generate_profile")
    steps, layers = 2, 4
    events = [kernel("sparse_pass", 30.0) for _ in range(steps * layers)]  # 30 µs a layer
    events += [kernel("_select_kernel", 10.0) for _ in range(steps * layers)]
    events += [kernel("nvjet_gemm", 500.0) for _ in range(steps)]  # not attention: counted in the device's time only
    events += [
        host("TorchDynamo Cache Lookup", 300.0),
        host("TorchDynamo Cache Lookup", 500.0),
        host("Torch-Compiled Region: 0/1", 2000.0),
        host("aten::mm", 9999.0),
    ]  # aten::mm: not a phase
    out = bench.summarize(events, layers, steps)
    assert out["device_ms"] == (steps * layers * 40.0 + steps * 500.0) / steps / 1000  # 0.66 ms a step
    assert out["launches_per_step"] == 2 * layers + 1
    assert out["attention_us_per_layer"] == {"sparse_pass": 30.0, "_select_kernel": 10.0}
    assert out["attention_us_per_layer_total"] == 40.0
    assert out["host_phases_ms_per_step_profiled"] == {"TorchDynamo Cache Lookup": 0.4, "Torch-Compiled Region": 1.0}
    assert [k["kernel"] for k in out["kernels"]] == ["nvjet_gemm", "sparse_pass", "_select_kernel"]  # longest first


def test_the_fused_step_s_prologue_and_cuda_shortlist_count_as_attention():
    """The fused step's first launch (``prologue``) and the CUDA shortlist, which the profiler names with its template
    (``void pq_shortlist<…>``), are attention kernels; a GEMM is not."""
    bench = load_benchmark("generate_profile")
    events = [kernel("prologue", 4.0), kernel("void pq_shortlist<4, 8>(Args)", 20.0), kernel("void nvjet_gemm", 9.0)]
    out = bench.summarize(events, layers=1, steps=1)
    assert out["attention_us_per_layer"] == {"void pq_shortlist<4, 8>(Args)": 20.0, "prologue": 4.0}
