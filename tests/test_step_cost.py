"""The step-cost counter (benchmarks/step_cost.py) counts what one step does: a few tiny tensors, one process."""

import torch

import step_cost


def test_adamw_foreach_counts_a_handful_of_ops_per_tensor_and_no_host_read():
    (count,) = step_cost.count_steps("adamw", 8, "cpu", small=True).values()
    assert 8 < count.total_ops < 10 * 8
    assert count.ops["_foreach_add_"] >= 1
    assert count.host_reads == 0 and count.counter_reads >= 8  # its step counters, on the host on every device


def test_demo_step_counts_its_host_reads_by_call_site():
    (count,) = step_cost.count_steps("demo", 8, "cpu", small=True).values()
    assert count.total_ops > 8 * 10  # DeMo's math is per parameter: the DCT, top-k, coding, checks
    assert count.scalar_reads >= 1 and count.host_reads >= count.scalar_reads
    assert sum(count.sites.values()) == count.host_reads
    assert any("guards.py" in site for site in count.sites)  # the non-finite check reads back once per device


def test_demo_payload_checks_read_back_once_whatever_the_number_of_tensors():
    def decode_reads(n: int) -> int:
        (count,) = step_cost.count_steps("demo", n, "cpu", small=True).values()
        return sum(k for site, k in count.sites.items() if site.startswith("codec.py:decode"))

    assert decode_reads(4) == decode_reads(16) == 1


def test_a_local_step_and_a_synchronising_step_are_counted_apart():
    counts = step_cost.count_steps("demo-sync4", 4, "cpu", small=True)
    assert set(counts) == {"sync", "local"}
    assert counts["local"].total_ops < counts["sync"].total_ops


def test_copies_between_devices_are_counted_with_their_bytes():
    with step_cost.StepCounter(on_cpu=False) as counter:
        torch.zeros(4).to("meta")
        torch.empty(2, device="meta").copy_(torch.zeros(2, dtype=torch.float64))
    assert (counter.count.h2d, counter.count.h2d_bytes, counter.count.d2h) == (2, 32, 0)


def test_the_ops_of_a_step_grow_with_the_distinct_shapes_not_with_the_tensors():
    def ops(n: int) -> int:
        (count,) = step_cost.count_steps("demo", n, "cpu", small=True).values()
        return count.total_ops

    assert ops(32) <= ops(8) * 1.2  # the same four shapes: the math runs once per bucket, not per tensor
