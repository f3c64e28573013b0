"""kernels.backend's shared launch state: ticket counters per (device, site) and the SM count."""
import torch

from deepinfer_sg.kernels import backend


def test_tickets_are_zero_shared_within_a_site_and_apart_across_sites():
    a = backend.tickets("cpu", 10, site="test-a")
    assert a.dtype == torch.int32 and a.shape == (10,) and int(a.abs().sum()) == 0
    a[3] = 7                                     # a launch in flight holds a ticket
    again = backend.tickets(torch.device("cpu"), 5, site="test-a")
    assert int(again[3]) == 7                    # same site, same storage: launches on one stream share
    other = backend.tickets("cpu", 10, site="test-b")
    assert int(other.abs().sum()) == 0 and other.data_ptr() != a.data_ptr()
    a[3] = 0


def test_tickets_grow_when_a_launch_needs_more():
    small = backend.tickets("cpu", 8, site="test-grow")
    big = backend.tickets("cpu", 10_000, site="test-grow")
    assert big.shape == (10_000,) and int(big.abs().sum()) == 0
    assert backend.tickets("cpu", 8, site="test-grow").data_ptr() == big.data_ptr()
    assert small.numel() == 8


def test_sm_count_off_gpu_is_the_h200s():
    assert backend.sm_count("cpu") == 132


def test_a_grown_buffer_stays_alive_for_graphs_captured_before():
    old = backend.tickets("cpu", 16, site="test-retire")
    backend.tickets("cpu", 100_000, site="test-retire")
    assert any(t.data_ptr() == old.data_ptr() for t in backend._RETIRED)
