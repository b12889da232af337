"""The efficiency factors: each a pure function with a physical meaning."""
import numpy as np
import pytest

from predictor import efficiency as eff


def test_eta_cluster_wave_quantization():
    # H100: 132 SMs, 128x256 tiles. 4096 x 6144 output -> 32 x 24 = 768 tiles -> 6 waves of 132 (792 slots)
    assert eff.eta_cluster(4096, 6144, 4096, 132, (128, 256)) == pytest.approx(768 / 792)
    # 133 tiles on 132 SMs: two waves, second almost empty
    assert eff.eta_cluster(133 * 128, 256, 4096, 132, (128, 256)) == pytest.approx(133 / 264)
    # exactly one full wave
    assert eff.eta_cluster(132 * 128, 256, 4096, 132, (128, 256)) == pytest.approx(1.0)


def test_eta_cluster_split_k_fills_idle_sms():
    # M=1 decode GEMV of N=4096: 16 tiles; K=4096 splits into min(132//16=8, 4096//256=16) = 8 -> 128 of 132
    assert eff.eta_cluster(1, 4096, 4096, 132, (128, 256)) == pytest.approx(128 / 132)
    # a short K cannot be split: 16 tiles, K=256 -> split 1
    assert eff.eta_cluster(1, 4096, 256, 132, (128, 256)) == pytest.approx(16 / 132)


def test_eta_cluster_vectorized_and_bounded():
    m = np.arange(1, 20000, 37)
    e = eff.eta_cluster(m, 14336, 4096, 108, eff.tile_shape("ampere"))
    assert e.shape == m.shape and np.all((e > 0) & (e <= 1))


def test_eta_mem_law():
    assert eff.eta_mem(0.477, 0.9, 0.477) == pytest.approx(0.45)  # x_half gives half of eta_max
    assert eff.eta_mem(1e6, 0.9, 0.477) == pytest.approx(0.9, rel=1e-5)
    x = np.logspace(-3, 2, 50)
    assert np.all(np.diff(eff.eta_mem(x, 0.9, 0.477)) > 0)


def test_clock_active_duty_identity():
    f = eff.f_clk(0.302)
    assert f == pytest.approx(0.698)
    assert eff.f_clk(None) == 1.0
    spec = 989.4e12
    # a peak loop at 650 TFLOP/s under that clock: delivery 650 / (989.4 * 0.698)
    active = eff.eta_active(650e12, spec, f)
    cluster = eff.eta_cluster(4096, 6144, 4096, 132, (128, 256))
    duty = eff.eta_duty(600e12, spec, f, cluster, active)
    # the identity the calibration relies on: eta_c * P reproduces the measured GEMM throughput
    assert spec * eff.eta_compute(f, cluster, active, duty) == pytest.approx(600e12)


def test_every_known_arch_has_a_tile():
    from gpubench.skus import gpu_skus

    for sku in gpu_skus().values():
        assert sku.arch in eff.TILE_SHAPES, sku.arch


def test_eta_duty_at_reproduces_nodes_interpolates_and_clamps():
    m_nodes = np.array([1.0, 2.0, 8.0, 64.0])
    duty = np.array([0.5, 0.1, 0.3, 0.6])
    lx, ly = np.log2(m_nodes), np.log(duty)
    assert eff.eta_duty_at(m_nodes, lx, ly) == pytest.approx(duty, rel=1e-12)
    # between 2 and 8 (log2 1 -> 3): power law, so M = 4 is the geometric mean of 0.1 and 0.3
    assert float(eff.eta_duty_at(4.0, lx, ly)) == pytest.approx(np.sqrt(0.1 * 0.3), rel=1e-12)
    # between 8 and 64: M = 16 is one third of the way in log2 M
    assert float(eff.eta_duty_at(16.0, lx, ly)) == pytest.approx(0.3 * 2.0 ** (1 / 3), rel=1e-12)
    # clamped outside the measured M (no extrapolation); M < 1 counts as 1
    assert eff.eta_duty_at([4096.0, 1e6], lx, ly) == pytest.approx([0.6, 0.6])
    assert float(eff.eta_duty_at(0.5, lx, ly)) == pytest.approx(0.5)


def test_duty_time_envelope_keeps_time_monotone_not_efficiency():
    m = np.array([1.0, 2.0, 4.0, 8.0])
    # M = 1 beats M = 2 per FLOP (kept: time still rises); M = 4 -> 8 more than doubles the
    # throughput, so an M = 4 GEMM would be slower than running it padded to M = 8: raised.
    duty = np.array([0.5, 0.1, 0.1, 0.3])
    env = eff.duty_time_envelope(m, duty)
    assert env == pytest.approx([0.5, 0.1, 0.15, 0.3])
    assert np.all(np.diff(m / env) >= 0)
    assert np.all(env >= duty)
    # already monotone in time: unchanged
    assert eff.duty_time_envelope(m, [0.5, 0.1, 0.15, 0.3]) == pytest.approx([0.5, 0.1, 0.15, 0.3])
