"""The hardware inventory: this machine's figures, NVIDIA GPUs through a real (fake) nvidia-smi
executable first on PATH, OpenVINO devices from a child process only, and no exception ever."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from modeld.observe.hardware import GPU, Hardware, inventory, nvidia_gpus, nvidia_smi_gpus

QUERY = "--query-gpu=index,name,memory.total,memory.free,driver_version,uuid --format=csv,noheader,nounits"


def _fake_nvidia_smi(bin_dir: Path, body: str) -> None:
    """A real executable named nvidia-smi; it refuses any query but the one modeld makes."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\nif [ "$*" != "{QUERY}" ]; then echo "unexpected arguments: $*" >&2; exit 64; fi\n' + body
    )
    script.chmod(0o755)


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return bin_dir


# --- this machine -------------------------------------------------------------------------------


def test_the_inventory_of_this_machine(tmp_path: Path) -> None:
    hw = inventory(tmp_path / "data" / "not-yet", max_age=0)
    assert hw.cpu_count == len(os.sched_getaffinity(0))
    assert hw.cpu_count_machine == os.cpu_count()
    assert hw.cpu_model
    assert hw.ram_total_bytes == psutil.virtual_memory().total
    assert 0 < hw.ram_available_bytes <= hw.ram_total_bytes
    assert hw.data_dir == str(tmp_path / "data" / "not-yet")
    assert hw.disk_path == str(tmp_path)  # the nearest existing parent
    usage = shutil.disk_usage(tmp_path)
    assert hw.disk_total_bytes == usage.total
    assert abs(hw.disk_free_bytes - usage.free) < 1 << 30  # other processes write meanwhile
    if shutil.which("nvidia-smi") is None and importlib.util.find_spec("pynvml") is None:
        assert hw.gpus == ()
    if importlib.util.find_spec("openvino") is not None:
        cpu = next(d for d in hw.openvino_devices if d.name == "CPU")
        assert cpu.full_name and cpu.memory_total_bytes is None
    assert hw.problems == ()
    assert hw.accelerators_taken_at is not None and not hw.accelerators_pending
    as_dict = json.loads(json.dumps(hw.to_dict()))
    assert list(as_dict) == [
        "cpu_count",
        "cpu_count_machine",
        "cpu_model",
        "cpu_quota",
        "ram_total_bytes",
        "ram_available_bytes",
        "memory_limit_bytes",
        "data_dir",
        "disk_path",
        "disk_total_bytes",
        "disk_free_bytes",
        "gpus",
        "openvino_devices",
        "taken_at",
        "accelerators_taken_at",
        "accelerators_pending",
        "problems",
    ]
    assert as_dict["problems"] == {}


def test_figures_are_reused_for_max_age(tmp_path: Path) -> None:
    first = inventory(tmp_path, max_age=3600)
    assert inventory(tmp_path, max_age=3600).taken_at == first.taken_at
    assert inventory(tmp_path, max_age=0).taken_at > first.taken_at


def test_a_failing_part_is_reported_not_raised() -> None:
    hw = inventory(12345, max_age=0)  # type: ignore[arg-type]
    assert (hw.data_dir, hw.disk_path, hw.disk_total_bytes, hw.disk_free_bytes) == ("", "", 0, 0)
    assert dict(hw.problems) == {"data_dir": "TypeError: expected str, bytes or os.PathLike object, not int"}
    assert hw.cpu_count >= 1 and hw.ram_total_bytes > 0  # the other parts are there


def test_openvino_is_never_imported_by_the_daemon_and_status_need_not_wait(tmp_path: Path) -> None:
    script = (
        "import json, sys\n"
        "from modeld.observe.hardware import inventory\n"
        "early = inventory(sys.argv[1], wait=False)\n"
        "late = inventory(sys.argv[1])\n"
        "print(json.dumps([early.accelerators_pending, early.accelerators_taken_at is None,\n"
        "                  late.accelerators_pending, late.accelerators_taken_at is None,\n"
        "                  [d.name for d in late.openvino_devices], 'openvino' in sys.modules]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    early_pending, early_none, late_pending, late_none, devices, imported = json.loads(run.stdout)
    assert (early_pending, early_none, late_pending, late_none) == (True, True, False, False)
    assert imported is False
    if importlib.util.find_spec("openvino") is not None:
        assert "CPU" in devices


# --- NVIDIA GPUs through nvidia-smi -------------------------------------------------------------


def test_gpus_listed_by_nvidia_smi(fake_bin: Path) -> None:
    _fake_nvidia_smi(
        fake_bin,
        "echo '0, NVIDIA GeForce RTX 4090, 24564, 23980, 550.54.14, GPU-0f3a'\n"
        "echo '1, NVIDIA A100-SXM4-80GB, 81920, [N/A], 550.54.14, GPU-77c1'\n",
    )
    gpus, problem = nvidia_smi_gpus()
    assert problem == ""
    assert gpus == (
        GPU(0, "NVIDIA GeForce RTX 4090", 24564 << 20, 23980 << 20, "550.54.14", "GPU-0f3a", "nvidia-smi"),
        GPU(1, "NVIDIA A100-SXM4-80GB", 81920 << 20, None, "550.54.14", "GPU-77c1", "nvidia-smi"),
    )
    if importlib.util.find_spec("pynvml") is None:  # then nvidia_gpus asks nvidia-smi directly
        assert nvidia_gpus() == (gpus, "")


def test_no_nvidia_smi_means_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_smi_gpus() == ((), "")


def test_a_driver_failure_is_a_problem_not_an_error(fake_bin: Path) -> None:
    _fake_nvidia_smi(
        fake_bin,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n',
    )
    assert nvidia_smi_gpus() == (
        (),
        "nvidia-smi exited with 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
    )


def test_output_modeld_does_not_understand_is_a_problem(fake_bin: Path) -> None:
    _fake_nvidia_smi(fake_bin, "echo 'No devices were found, sorry'\n")
    assert nvidia_smi_gpus() == (
        (),
        "nvidia-smi printed a line modeld does not understand: ['No devices were found', 'sorry']",
    )


def test_a_hung_nvidia_smi_is_killed_with_its_children(fake_bin: Path, tmp_path: Path) -> None:
    """The fake starts a child that would outlive the test's own timeout if it were left."""
    pid_file = tmp_path / "child.pid"
    _fake_nvidia_smi(fake_bin, f"sleep 600 &\necho $! > {pid_file}\nwait\n")
    # 5 s: long enough for the fake to start its child even on a loaded machine.
    assert nvidia_smi_gpus(timeout=5.0) == ((), "nvidia-smi did not answer within 5 s")
    child = int(pid_file.read_text())
    # SIGKILL was sent to the group; on a loaded machine the child may still show as running for
    # a moment before it dies. A child that was never killed sleeps on for 600 s and fails this.
    deadline = time.monotonic() + 5.0
    status = "running"
    while time.monotonic() < deadline:
        try:
            status = psutil.Process(child).status()
        except psutil.NoSuchProcess:
            return  # gone
        if status == psutil.STATUS_ZOMBIE:  # dead and not yet reaped
            return
        time.sleep(0.05)
    raise AssertionError(f"the hung tool's child is still {status} 5 s after the timeout")


def test_hardware_is_frozen() -> None:
    hw = inventory(max_age=3600)
    assert isinstance(hw, Hardware)
    with pytest.raises(AttributeError):
        hw.cpu_count = 99  # type: ignore[misc]
