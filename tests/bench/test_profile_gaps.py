"""profile_gaps on hand-made spans: the device's merged busy time, its idle gaps, and each gap charged to the host
calls that overlap it (the rest to code that made no call)."""
import pytest

from mimw.bench.profile_gaps import Span, around, busy_by_op, charge, format_summary, gaps, merged, short, summary


def test_busy_spans_merge_and_leave_the_gaps_between_them():
    dev = [Span(0, 10, "k1"), Span(5, 20, "k2"), Span(100, 110, "k3"), Span(115, 130, "k4"), Span(1130, 1140, "k5")]
    assert merged(dev) == [(0, 20), (100, 110), (115, 130), (1130, 1140)]
    assert gaps(dev, 20) == [(20, 100), (130, 1130)]  # the 5 us gap is under the threshold
    assert gaps(dev, 1) == [(20, 100), (110, 115), (130, 1130)]


def test_a_gap_is_charged_to_the_calls_overlapping_it_and_the_rest_to_no_call():
    host = [Span(0, 40, "cudaEventSynchronize"), Span(60, 90, "cudaGraphLaunch"), Span(70, 80, "aten::copy_"),
            Span(200, 300, "cudaMemcpyAsync")]
    got = charge((20, 100), host)
    # 20..40 event wait, 60..90 launch (and the copy nested in it), 40..60 and 90..100 no call
    assert got == pytest.approx({"cudaEventSynchronize": 20, "cudaGraphLaunch": 30, "aten::copy_": 10,
                                 "(no call)": 30})


def test_summary_counts_gaps_by_size_and_lists_the_largest_first():
    dev = [Span(0, 100, "a"), Span(150, 200, "b"), Span(1500, 1600, "c"), Span(1830, 1900, "d")]
    host = [Span(200, 1500, "cudaEventSynchronize")]
    s = summary(dev, host, min_gap_us=20, top=2)
    assert s["window_us"] == 1900
    assert s["busy_share"] == pytest.approx(320 / 1900)
    assert s["gaps"][">=20us"] == {"count": 3, "us": 50 + 1300 + 230}
    assert s["gaps"][">=1000us"] == {"count": 1, "us": 1300}
    assert [g["us"] for g in s["largest"]] == [1300, 230]
    assert s["largest"][0]["host"] == {"cudaEventSynchronize": 1300, "(no call)": 0}
    assert s["gap_time_by_host_call"]["(no call)"] == pytest.approx(50 + 230)
    text = format_summary(s)
    assert "device busy 16.8%" in text and "gap 1300 us at +0.20 ms: cudaEventSynchronize 1300 us" in text


def test_no_device_work_is_an_empty_summary():
    assert summary([], [Span(0, 1, "x")])["busy_share"] == 0.0


def test_kernel_names_are_cut_to_their_function():
    assert short("void at::native::(anonymous namespace)::reduce_kernel<512, 1>(float*)") == "reduce_kernel"
    assert short("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH "
    assert short("megakernel_step") == "megakernel_step"


def test_gaps_are_placed_between_the_device_ops_around_them():
    # two steps: graph kernel, argmax, copy; the host is late before the argmax of the first step and before the
    # second step's graph kernel
    dev = [Span(0, 100, "step_kernel"), Span(130, 135, "void argmax_kernel<float>(float*)"),
           Span(136, 140, "Memcpy DtoH"), Span(200, 300, "step_kernel"), Span(301, 305, "argmax_kernel")]
    got = around(gaps(dev, 20), dev)
    assert got == {"Memcpy DtoH -> step_kernel": 60, "step_kernel -> argmax_kernel": 30}
    assert list(got) == ["Memcpy DtoH -> step_kernel", "step_kernel -> argmax_kernel"]  # largest first
    s = summary(dev, [Span(100, 130, "mimw.commit")], min_gap_us=20)
    assert s["gap_time_by_device_ops"] == got
    assert s["gap_time_by_host_call"]["mimw.commit"] == 30
    assert "gap time by device ops around it: Memcpy DtoH -> step_kernel 0.06 ms" in format_summary(s)


def test_device_time_a_step_by_op():
    dev = [Span(0, 100, "step_kernel"), Span(130, 136, "void argmax<f>(float*)"), Span(200, 300, "step_kernel"),
           Span(301, 305, "argmax")]
    assert busy_by_op(dev, 2) == {"step_kernel": 100, "argmax": 5}
