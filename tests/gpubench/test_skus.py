import pytest

from common.errors import SKUMismatchError, UnknownSKUError
from gpubench import skus


def test_spec_identity_h100_sxm_bf16():
    # 132 SM x 4 TC x 512 FMA x 2 x 1.83 GHz
    assert skus.get("h100-sxm").peak_flops("bf16") / 1e12 == pytest.approx(989.4, abs=0.05)


def test_spec_identity_a100_bf16():
    # 108 x 4 x 256 x 2 x 1.41 GHz
    assert skus.get("a100-80").peak_flops("bf16") / 1e12 == pytest.approx(311.9, abs=0.05)
    assert skus.get("a100-40").peak_flops("bf16") == skus.get("a100-80").peak_flops("bf16")


@pytest.mark.parametrize("sku_id,tflops", [("l40s", 362.0), ("rtx-5090", 209.5), ("b200", 2250.0), ("h100-pcie", 756.0),
                                            ("b300", 2250.0), ("gb200", 2500.0), ("gb300", 2500.0), ("rtx-pro-6000", 467.8)])
def test_spec_identity_matches_datasheets(sku_id, tflops):
    assert skus.get(sku_id).peak_flops("bf16") / 1e12 == pytest.approx(tflops, rel=0.002)


def test_required_entries_and_sources():
    ids = skus.all_ids()
    for required in ("a100-40", "a100-80", "h100-sxm", "h100-pcie", "h200", "l40s", "rtx-5090", "b200", "b300", "gb200", "gb300",
                     "rtx-pro-6000", "cpu"):
        assert required in ids
    for sku in skus.gpu_skus().values():
        for fig in ("sm_count", "fma_per_tc_per_clk", "spec_clock_mhz", "memory_bw_gbs", "l2_mb", "memory_gb"):
            assert fig in sku.source, f"{sku.id} has no source for {fig}"
        for fig in ("nvlink_gbs", "nic_gbs", "host_link_gbs"):  # the links a KV transfer may take
            if getattr(sku, fig) is not None:
                assert fig in sku.source, f"{sku.id} has no source for {fig}"


def test_published_constants():
    assert skus.get("h200").s_floor_ms == 3.73
    assert skus.get("l40s").clock_droop == pytest.approx(0.427)


def test_aliases_and_unknown_suggestions():
    assert skus.get("H100").id == "h100-sxm"
    with pytest.raises(UnknownSKUError, match="did you mean: h100"):
        skus.get("h10")


def test_cpu_entry_is_built_from_host():
    cpu = skus.cpu_sku()
    from gpubench.hostinfo import host_cpu

    h = host_cpu()
    assert cpu.backend == "cpu" and cpu.sm_count == h.num_cpus
    lanes64 = h.vector_bits // 64
    expected = h.num_cpus * lanes64 * h.fma_units_per_core * 2 * h.clock_mhz * 1e6
    assert cpu.peak_flops("fp64") == pytest.approx(expected)


def test_detect_prefers_longest_pattern():
    assert skus.detect("NVIDIA H100 PCIe").id == "h100-pcie"
    assert skus.detect("NVIDIA H100 80GB HBM3").id == "h100-sxm"
    assert skus.detect("NVIDIA L40S").id == "l40s"
    assert skus.detect("Some Other GPU") is None


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA A100 80GB PCIe"])
def test_detect_tells_other_parts_of_the_same_name_apart(name):
    # a Grace Hopper superchip is not an SXM H200 ('H200' inside 'GH200' is no match), an NVL or PCIe
    # card not the SXM part: the table has none of them, and says so rather than take the SXM's figures
    assert skus.detect(name) is None
    assert skus.detect("NVIDIA H200").id == "h200" and skus.detect("NVIDIA B200").id == "b200"


def test_a_gpu_sku_without_the_extension_says_how_to_build_it():
    reason = "gpubench._cuda is not built (No module named 'gpubench._cuda'); rebuild with nvcc on PATH (GPUBENCH_CUDA=1 pip install -e .)"
    with pytest.raises(SKUMismatchError) as err:
        skus.check_matches(skus.get("l40s"), "AMD EPYC (2 CPUs)", "cpu", gpu_unusable=reason)
    assert str(err.value) == f"--sku l40s: the GPU cannot be measured: {reason}"
    with pytest.raises(SKUMismatchError, match="this machine has no NVIDIA L40S .*no usable GPU: no driver"):
        skus.check_matches(skus.get("l40s"), "AMD EPYC (2 CPUs)", "cpu", gpu_unusable="no driver")


def test_mismatch_is_an_error_unless_forced():
    with pytest.raises(SKUMismatchError):
        skus.check_matches(skus.get("h100-sxm"), "NVIDIA A100-SXM4-80GB", "cuda")
    skus.check_matches(skus.get("h100-sxm"), "NVIDIA A100-SXM4-80GB", "cuda", force=True)
    with pytest.raises(SKUMismatchError, match="this machine has no NVIDIA H100"):
        skus.check_matches(skus.get("h100-sxm"), "AMD EPYC", "cpu")
    # across backends --force is no way out: the CPU's rows would be filed under the GPU's id
    with pytest.raises(SKUMismatchError, match="gpubench predict --sku h100-sxm"):
        skus.check_matches(skus.get("h100-sxm"), "AMD EPYC", "cpu", force=True)
    with pytest.raises(SKUMismatchError, match="--device cpu"):
        skus.check_matches(skus.get("cpu"), "NVIDIA H100 80GB HBM3", "cuda", force=True)
