"""The runner's choice of probes: what a run measures and what it says it leaves out."""


def test_a_quick_run_leaves_out_vllm_ops_says_so_and_records_it(tmp_path):
    """A quick run is a minute's sanity check; vllm_ops takes ~90 s alone, so --quick skips it unless
    --probes names it, and the start line and the manifest say what is then missing."""
    from gpubench.results import read_manifest
    from gpubench.runner import RunRequest, open_run

    writer, _, line = open_run(RunRequest(device="cpu", quick=True, out=str(tmp_path / "q")))
    manifest = read_manifest(writer.run_dir)
    assert "vllm_ops" not in manifest["probes"] and "torch_ops" in manifest["probes"]
    assert "--quick leaves out vllm_ops (vLLM's own kernels" in line
    assert set(manifest["config"]["quick_left_out"]) == {"vllm_ops"}
    named, _, line = open_run(RunRequest(device="cpu", quick=True, probes=("stream", "vllm_ops"), out=str(tmp_path / "n")))
    assert list(read_manifest(named.run_dir)["probes"]) == ["stream", "vllm_ops"]
    assert "leaves out" not in line and read_manifest(named.run_dir)["config"]["quick_left_out"] == {}
    full, _, _ = open_run(RunRequest(device="cpu", out=str(tmp_path / "f")))
    assert "vllm_ops" in read_manifest(full.run_dir)["probes"]
