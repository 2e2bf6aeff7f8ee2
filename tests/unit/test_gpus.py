"""infra.gpus against a fake nvidia-smi script on PATH: free, busy, hidden usage, missing, broken."""

from __future__ import annotations

import stat

import pytest

from infra.gpus import (
    GpuBusyError,
    GpuQueryError,
    activation_bytes_per_token,
    check_gpus_free,
    list_gpus,
    token_budget,
)

H200 = "NVIDIA H200"
TWO_IDLE = f"0, GPU-aaa, {H200}, 143771, 4\n1, GPU-bbb, {H200}, 143771, 4\n"


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """Put a fake nvidia-smi first on PATH; returns a function that sets what it prints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu=*) cat {tmp_path}/gpus.csv; exit $(cat {tmp_path}/rc 2>/dev/null || echo 0);;
  --query-compute-apps=*) cat {tmp_path}/apps.csv;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    def configure(gpus: str, apps: str = "", rc: int = 0) -> None:
        (tmp_path / "gpus.csv").write_text(gpus)
        (tmp_path / "apps.csv").write_text(apps)
        (tmp_path / "rc").write_text(str(rc))

    return configure


def test_lists_gpus_with_memory(fake_smi):
    """Two idle GPUs are listed with index, name, memory and no processes."""
    fake_smi(TWO_IDLE)
    gpus = list_gpus()
    assert [(g.index, g.name, g.total_mib, g.used_mib, g.processes) for g in gpus] == [
        (0, H200, 143771, 4, ()),
        (1, H200, 143771, 4, ()),
    ]
    assert gpus[0].free_bytes == (143771 - 4) * 2**20


def test_idle_gpus_pass_the_check(fake_smi):
    """check_gpus_free returns the requested GPUs, in the requested order, when nobody holds them."""
    fake_smi(TWO_IDLE)
    assert [g.index for g in check_gpus_free([1, 0])] == [1, 0]


def test_busy_gpu_error_names_pid_process_and_memory(fake_smi):
    """A GPU with a compute process fails the check with its pid, process name and MiB held."""
    fake_smi(
        f"0, GPU-aaa, {H200}, 143771, 4\n1, GPU-bbb, {H200}, 143771, 70000\n",
        "GPU-bbb, 4242, /usr/bin/python3, 69990\n",
    )
    assert check_gpus_free([0])  # the idle one is fine
    with pytest.raises(GpuBusyError) as exc:
        check_gpus_free([0, 1])
    message = str(exc.value)
    assert "GPU 1" in message and "pid 4242" in message and "/usr/bin/python3" in message and "69990 MiB" in message
    assert "GPU 0" not in message


def test_allow_shared_returns_busy_gpus_with_their_processes(fake_smi):
    """allow_shared=True does not raise, and the caller still sees who holds memory."""
    fake_smi(TWO_IDLE.replace("143771, 4\n1", "143771, 5000\n1"), "GPU-aaa, 77, vllm, 4990\n")
    (gpu,) = check_gpus_free([0], allow_shared=True)
    assert [(p.pid, p.name, p.used_mib) for p in gpu.processes] == [(77, "vllm", 4990)]


def test_memory_held_by_invisible_processes_counts_as_busy(fake_smi):
    """Used memory above the idle level without a visible process (another container) fails the check."""
    fake_smi(f"0, GPU-aaa, {H200}, 143771, 50000\n", "")
    with pytest.raises(GpuBusyError, match="not visible here"):
        check_gpus_free([0])


def test_missing_gpu_index_is_named(fake_smi):
    """Asking for a GPU that does not exist names it and lists the ones that do."""
    fake_smi(TWO_IDLE)
    with pytest.raises(GpuBusyError, match=r"\[3\] not found \(nvidia-smi lists: 0, 1\)"):
        check_gpus_free([3])


def test_no_nvidia_smi_means_no_gpus(tmp_path, monkeypatch):
    """Without nvidia-smi on PATH there are no GPUs, and asking for one fails clearly."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert list_gpus() == []
    with pytest.raises(GpuBusyError, match="lists: none"):
        check_gpus_free([0])


def test_failing_nvidia_smi_raises_with_its_output(fake_smi):
    """An nvidia-smi that exits non-zero (no driver) raises GpuQueryError with its message."""
    fake_smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", rc=9)
    with pytest.raises(GpuQueryError, match="couldn't communicate"):
        list_gpus()


def test_not_available_memory_fields_parse(fake_smi):
    """'[N/A]' memory (MIG mode) reads as 0 MiB instead of crashing, and 'no processes' notes are ignored."""
    fake_smi(f"0, GPU-aaa, {H200}, [N/A], [N/A]\n", "No running processes found\n")
    (gpu,) = list_gpus()
    assert (gpu.total_mib, gpu.used_mib, gpu.processes) == (0, 0, ())


def test_bytes_per_token_follows_the_documented_formula():
    """Llama-8B-like shapes give dtype * (2*L*kv + (aux+1)*H + 4H + 2kv + 3I) + 4*vocab bytes per token."""
    h, layers, kv, inter, vocab = 4096, 32, 1024, 14336, 128256
    expected = 2 * (2 * layers * kv + 4 * h + 4 * h + 2 * kv + 3 * inter) + 4 * vocab
    assert activation_bytes_per_token(h, layers, kv_size=kv, intermediate_size=inter, vocab_size=vocab) == expected
    assert activation_bytes_per_token(64, 4) == 2 * (2 * 4 * 64 + 4 * 64 + 4 * 64 + 2 * 64 + 3 * 256)


def test_token_budget_subtracts_reserve_and_headroom():
    """Budget = floor((free - reserved) * (1 - headroom) / bytes_per_token), never negative."""
    assert token_budget(100 * 2**20, 2**20, reserved_bytes=20 * 2**20, headroom=0.25) == 60
    assert token_budget(10, 100, reserved_bytes=50) == 0
    with pytest.raises(ValueError):
        token_budget(10, 0)


def test_fake_smi_fixture_is_really_used(fake_smi):
    """The PATH override takes effect (guards the tests above against a real nvidia-smi)."""
    fake_smi("5, GPU-zzz, Fake GPU, 10, 1\n")
    assert [g.name for g in list_gpus()] == ["Fake GPU"]
