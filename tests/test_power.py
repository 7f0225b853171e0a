"""benchmarks/power.py: reading nvidia-smi's samples, and one sustained window on the GPU."""
import pytest
import torch

from benchmarks import power


def test_settled_medians_drop_the_first_third():
    lines = ["1980, 300.0, 40, 0x0000000000000000"] * 3 + ["1500, 690.5, 55, 0x0000000000000004"] * 6
    s = power.parse_samples("\n".join(lines) + "\n")
    assert s == {"sm_clock_mhz": 1500.0, "power_w": 690.5, "temperature_c": 55.0,
                 "throttle": ["0x0000000000000004"]}


def test_masks_seen_are_all_kept():
    lines = ["1700, 600, 50, 0x0", "1700, 600, 50, 0x4", "1600, 650, 51, 0x0", "1650, 640, 51, 0x4"]
    assert power.parse_samples("\n".join(lines))["throttle"] == ["0x0", "0x4"]


@pytest.mark.parametrize("text", ["", "\n\n", "[N/A], [N/A]\n"])
def test_no_samples_is_an_error(text):
    with pytest.raises(RuntimeError, match="no samples"):
        power.parse_samples(text)


@pytest.mark.parametrize("argv,match", [(["--configs", "nope"], "--configs"), (["--seconds", "0"], "--seconds"),
                                        (["--cool-ms", "-1"], "--cool-ms")])
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        power.parse_args(argv)
    assert match in capsys.readouterr().err


@pytest.mark.gpu
def test_sustained_window_times_the_calls_and_samples_the_board():
    a = torch.randn(2048, 2048, dtype=torch.bfloat16, device="cuda")
    s = power.sustained(lambda: a @ a, 0.5)
    assert s["calls"] >= 10 and s["us"] > 0
    assert 100 < s["sm_clock_mhz"] < 3000 and 20 < s["power_w"] < 2000
    assert s["throttle"] and all(t.startswith("0x") for t in s["throttle"])


@pytest.mark.gpu
def test_cooled_and_kernel_sum_time_the_call():
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    one = power.cooled(lambda: torch.mm(a, a, out=b), 2.0, reps=5)
    two = power.cooled(lambda: (torch.mm(a, a, out=b), torch.mm(a, a, out=b)), 2.0, reps=5)
    assert 0 < one < two
    assert 0.5 * one < power.eager_kernel_sum(lambda: torch.mm(a, a, out=b), reps=5) < 2 * two
