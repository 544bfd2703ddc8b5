"""The machine's hardware, as a coordinator needs it to place models: CPUs, memory, disk under
the data directory, GPUs and OpenVINO devices.

What: :func:`inventory` returns a frozen :class:`Hardware` (``to_dict()`` for JSON and status
output). It never raises: a part that cannot be inventoried is left empty and named, with the
reason, in ``problems``.

* CPUs: those this process may run on (``sched_getaffinity``), the machine's count, the model
  name, and a cgroup CPU quota if one is set.
* Memory: total and available RAM (psutil), and a cgroup memory limit if one is set (a
  container's RAM is its limit, not the host's).
* Disk: total and free bytes of the file system holding the data directory (or its nearest
  existing parent, if it does not exist yet).
* NVIDIA GPUs (:func:`nvidia_gpus`): through NVML when ``pynvml`` (``nvidia-ml-py``) is
  installed, else ``nvidia-smi``; either way in a child process with a timeout, so a wedged
  driver can hang neither the daemon nor a request thread, and the daemon never loads the NVML
  library. No driver, no library and no binary simply mean no GPU.
* OpenVINO devices (:func:`openvino_devices`, CPU, GPU.0, NPU, ...; its GPU plugin is how
  OpenCL devices show up): only from a child process that imports ``openvino``, with a timeout.
  The daemon process never imports openvino itself (its threads and allocator would live in
  the daemon for good).

Cost and freshness: CPU, memory and disk figures are read again when older than ``max_age``
(default 5 s); accelerators at most every :data:`ACCELERATOR_MAX_AGE` seconds (a child process
each, about a second for OpenVINO), refreshed on a background thread. ``inventory(wait=False)``
never waits for that refresh: it returns what is known (``accelerators_pending`` says when the
first inventory is still running), so a status call always answers at once.

What not: no per-process GPU usage, no NUMA topology, no hot-plug notification.
Record: ``blueprints/0013-probing-and-inventory.md``.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "ACCELERATOR_MAX_AGE",
    "GPU",
    "Hardware",
    "OpenVINODevice",
    "inventory",
    "nvidia_gpus",
    "nvidia_smi_gpus",
    "openvino_devices",
]

ACCELERATOR_MAX_AGE = 300.0
"""Seconds an accelerator inventory is reused (each costs a child process)."""
NVIDIA_TIMEOUT = 10.0
OPENVINO_TIMEOUT = 60.0
_MAX_PROBLEM = 300
_MIB = 1 << 20
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


@dataclass(frozen=True, slots=True)
class GPU:
    """One NVIDIA GPU."""

    index: int
    name: str
    memory_total_bytes: int
    memory_free_bytes: int | None  # as of Hardware.accelerators_taken_at
    driver_version: str
    uuid: str
    source: str  # nvml | nvidia-smi


@dataclass(frozen=True, slots=True)
class OpenVINODevice:
    """One device OpenVINO can run on (``CPU``, ``GPU.0``, ``NPU``, ...)."""

    name: str
    full_name: str
    device_type: str  # integrated | discrete | "" (as OpenVINO reports it)
    memory_total_bytes: int | None  # GPUs only


@dataclass(frozen=True, slots=True)
class Hardware:
    """The machine, as of ``taken_at`` (and ``accelerators_taken_at`` for GPUs and devices)."""

    cpu_count: int  # CPUs this process may run on
    cpu_count_machine: int
    cpu_model: str
    cpu_quota: float | None  # cgroup CPU limit in CPUs (1.5 = one and a half), None: none
    ram_total_bytes: int
    ram_available_bytes: int
    memory_limit_bytes: int | None  # cgroup memory limit, None: none
    data_dir: str
    disk_path: str  # where the disk figures were taken (data_dir or its nearest existing parent)
    disk_total_bytes: int
    disk_free_bytes: int
    gpus: tuple[GPU, ...]
    openvino_devices: tuple[OpenVINODevice, ...]
    taken_at: float
    accelerators_taken_at: float | None  # None: not inventoried yet
    accelerators_pending: bool = False  # the first accelerator inventory is still running
    problems: tuple[tuple[str, str], ...] = field(default=())  # (part, why it is missing)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (tuples as lists, problems as a mapping)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("gpus", "openvino_devices"):
                value = [asdict(item) for item in value]
            elif f.name == "problems":
                value = dict(value)
            out[f.name] = value
        return out


def _problem(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_PROBLEM else text[: _MAX_PROBLEM - 3] + "..."


# --- CPU, memory, disk ---------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _cgroup_limits() -> tuple[int | None, float | None]:
    """(memory limit in bytes, CPU quota in CPUs) of this process's cgroup, None where unset.

    cgroup v2: the smallest ``memory.max`` / ``cpu.max`` from the process's group up to the
    root; v1: the memory and cpu controllers' own files."""
    root = Path("/sys/fs/cgroup")
    groups: dict[str, str] = {}
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                groups[controller] = parts[2]
    memory: int | None = None
    quota: float | None = None
    if "" in groups and (root / "cgroup.controllers").exists():  # v2
        here = root / groups[""].lstrip("/")
        for directory in (here, *here.parents):
            if not directory.is_relative_to(root):
                break
            mem = _read(directory / "memory.max")
            if mem and mem.isdigit():
                memory = min(int(mem), memory or int(mem))
            cpu = (_read(directory / "cpu.max") or "").split()
            if len(cpu) == 2 and cpu[0].isdigit() and cpu[1].isdigit() and int(cpu[1]):
                cpus = int(cpu[0]) / int(cpu[1])
                quota = min(cpus, quota or cpus)
        return memory, quota
    for base in (root / "memory" / groups.get("memory", "").lstrip("/"), root / "memory"):
        mem = _read(base / "memory.limit_in_bytes")
        if mem and mem.isdigit():
            memory = int(mem) if int(mem) < _UNLIMITED else None
            break
    for base in (root / "cpu" / groups.get("cpu", "").lstrip("/"), root / "cpu"):
        q, p = _read(base / "cpu.cfs_quota_us"), _read(base / "cpu.cfs_period_us")
        if q is not None and p is not None:
            if q.isdigit() and p.isdigit() and int(p):
                quota = int(q) / int(p)
            break
    return memory, quota


def _disk(data_dir: Path) -> tuple[Path, int, int]:
    """The nearest existing path at or above ``data_dir``, and its file system's total and free."""
    path = data_dir
    while not path.exists() and path != path.parent:
        path = path.parent
    usage = shutil.disk_usage(path)
    return path, usage.total, usage.free


# --- accelerators --------------------------------------------------------------------------------

_NVML_SCRIPT = """
import json, pynvml
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as exc:
    print(json.dumps({"absent": str(exc)}))
    raise SystemExit(0)
def text(v):
    return v.decode() if isinstance(v, bytes) else str(v)
driver = text(pynvml.nvmlSystemGetDriverVersion())
gpus = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    gpus.append([i, text(pynvml.nvmlDeviceGetName(h)), int(mem.total), int(mem.free), driver,
                 text(pynvml.nvmlDeviceGetUUID(h))])
pynvml.nvmlShutdown()
print(json.dumps({"gpus": gpus}))
"""

_OPENVINO_SCRIPT = """
import json, openvino
core = openvino.Core()
out = []
for name in core.available_devices:
    def prop(key, default=""):
        try:
            return core.get_property(name, key)
        except Exception:
            return default
    kind = str(prop("DEVICE_TYPE")).rsplit(".", 1)[-1].lower()
    memory = prop("GPU_DEVICE_TOTAL_MEM_SIZE", None) if name.startswith("GPU") else None
    out.append([name, str(prop("FULL_DEVICE_NAME")), kind, None if memory is None else int(memory)])
print(json.dumps(out))
"""


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a child in its own process group; on timeout kill the whole group (a wedged tool's
    own children included, or the pipes would stay open) and raise ``TimeoutExpired``."""
    with subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def _python(script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-c", script], timeout)


def _int_or_none(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def nvidia_smi_gpus(timeout: float = NVIDIA_TIMEOUT) -> tuple[tuple[GPU, ...], str]:
    """The GPUs ``nvidia-smi`` (found on ``PATH``) lists, and what went wrong ("" if nothing).

    No ``nvidia-smi`` on ``PATH`` means no NVIDIA GPU: ``((), "")``."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return (), ""
    query = "index,name,memory.total,memory.free,driver_version,uuid"
    try:
        run = _run([binary, f"--query-gpu={query}", "--format=csv,noheader,nounits"], timeout)
    except subprocess.TimeoutExpired:
        return (), f"nvidia-smi did not answer within {timeout:g} s"
    except OSError as exc:
        return (), _problem(exc)
    if run.returncode != 0:
        said = (run.stdout + " " + run.stderr).strip() or "no output"
        return (), _problem(f"nvidia-smi exited with {run.returncode}: {said}")
    gpus: list[GPU] = []
    for row in csv.reader(run.stdout.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != 6 or not row[0].strip().isdigit():
            return tuple(gpus), _problem(f"nvidia-smi printed a line modeld does not understand: {row!r}")
        index, name, total, free, driver, uuid = (cell.strip() for cell in row)
        free_mib = _int_or_none(free)
        gpus.append(
            GPU(
                index=int(index),
                name=name,
                memory_total_bytes=(_int_or_none(total) or 0) * _MIB,
                memory_free_bytes=None if free_mib is None else free_mib * _MIB,
                driver_version=driver,
                uuid=uuid,
                source="nvidia-smi",
            )
        )
    return tuple(gpus), ""


def nvidia_gpus(timeout: float = NVIDIA_TIMEOUT) -> tuple[tuple[GPU, ...], str]:
    """NVIDIA GPUs through NVML (``pynvml``, in a child process) when it is installed and finds
    a driver, else through ``nvidia-smi``; and what went wrong ("" if nothing)."""
    if importlib.util.find_spec("pynvml") is None:
        return nvidia_smi_gpus(timeout)
    problem = ""
    try:
        run = _python(_NVML_SCRIPT, timeout)
    except subprocess.TimeoutExpired:
        return (), f"NVML did not answer within {timeout:g} s"
    except OSError as exc:
        problem = _problem(exc)
    else:
        try:
            answer = json.loads(run.stdout) if run.returncode == 0 else {}
        except ValueError:
            answer = {}
        if "gpus" in answer:
            return tuple(
                GPU(int(i), str(name), int(total), int(free), str(driver), str(uuid), "nvml")
                for i, name, total, free, driver, uuid in answer["gpus"]
            ), ""
        if "absent" not in answer:  # NVML found no driver: not a problem, there is no GPU
            problem = _problem(f"NVML failed: {run.stderr.strip()[-_MAX_PROBLEM:]}")
    gpus, smi_problem = nvidia_smi_gpus(timeout)
    return gpus, smi_problem or ("" if gpus else problem)


def openvino_devices(timeout: float = OPENVINO_TIMEOUT) -> tuple[tuple[OpenVINODevice, ...], str]:
    """The devices OpenVINO sees, asked in a child process; and what went wrong ("" if nothing).

    OpenVINO not installed: ``((), "")``."""
    if importlib.util.find_spec("openvino") is None:
        return (), ""
    try:
        run = _python(_OPENVINO_SCRIPT, timeout)
    except subprocess.TimeoutExpired:
        return (), f"OpenVINO did not list its devices within {timeout:g} s"
    except OSError as exc:
        return (), _problem(exc)
    if run.returncode != 0:
        return (), _problem(f"OpenVINO failed: {run.stderr.strip()[-_MAX_PROBLEM:]}")
    try:
        return tuple(OpenVINODevice(*row) for row in json.loads(run.stdout)), ""
    except (ValueError, TypeError) as exc:
        return (), _problem(exc)


@dataclass(frozen=True, slots=True)
class _Accelerators:
    gpus: tuple[GPU, ...]
    devices: tuple[OpenVINODevice, ...]
    problems: tuple[tuple[str, str], ...]
    taken_at: float


class _AcceleratorCache:
    """One accelerator inventory at a time, on a background thread, reused for a while."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: _Accelerators | None = None
        self._refresh: threading.Thread | None = None

    def get(self, wait: bool) -> tuple[_Accelerators | None, bool]:
        """(the freshest inventory known, whether one is being taken now)."""
        with self._lock:
            value = self._value
            if value is not None and time.monotonic() - value.taken_at < ACCELERATOR_MAX_AGE:
                return value, False
            if self._refresh is None:
                self._refresh = threading.Thread(target=self._take, name="modeld-hw-inventory", daemon=True)
                self._refresh.start()
            refresh = self._refresh
        if wait and value is None:  # the first inventory: wait for it; later ones refresh behind
            refresh.join()
            with self._lock:
                return self._value, False
        return value, True

    def _take(self) -> None:
        problems: list[tuple[str, str]] = []
        try:
            gpus, problem = nvidia_gpus()
            if problem:
                problems.append(("gpus", problem))
            devices, problem = openvino_devices()
            if problem:
                problems.append(("openvino_devices", problem))
            value = _Accelerators(gpus, devices, tuple(problems), time.monotonic())
        except Exception as exc:  # never leave a caller without an answer
            value = _Accelerators((), (), (("accelerators", _problem(exc)),), time.monotonic())
        with self._lock:
            self._value = value
            self._refresh = None


_accelerators = _AcceleratorCache()
_cache_lock = threading.Lock()
_cache: dict[str, tuple[float, Hardware]] = {}


def inventory(
    data_dir: str | os.PathLike[str] | None = None, *, max_age: float = 5.0, wait: bool = True
) -> Hardware:
    """The machine's hardware; CPU, memory and disk figures at most ``max_age`` seconds old.

    ``data_dir`` defaults to the daemon's data directory. ``wait=False`` never waits for the
    accelerator inventory (a child process): it returns the last one, or none yet. Never raises.
    """
    problems: list[tuple[str, str]] = []
    try:
        if data_dir is None:
            from modeld.paths import default_data_dir

            data_dir = default_data_dir()
        directory = os.fspath(data_dir)
    except Exception as exc:
        directory = ""
        problems.append(("data_dir", _problem(exc)))
    accelerators, pending = _accelerators.get(wait)
    now_wall, now = time.time(), time.monotonic()
    with _cache_lock:
        cached = _cache.get(directory)
    if cached is not None and now - cached[0] < max_age and not problems:
        base = cached[1]
    else:
        base = _take(directory, problems, now_wall)
        with _cache_lock:
            _cache[directory] = (now, base)
    if accelerators is None:
        return _with(base, (), (), None, pending)
    taken = now_wall - (now - accelerators.taken_at)
    return _with(base, accelerators.gpus, accelerators.devices, taken, pending, accelerators.problems)


def _with(
    base: Hardware,
    gpus: tuple[GPU, ...],
    devices: tuple[OpenVINODevice, ...],
    taken: float | None,
    pending: bool,
    problems: tuple[tuple[str, str], ...] = (),
) -> Hardware:
    return replace(
        base,
        gpus=gpus,
        openvino_devices=devices,
        accelerators_taken_at=taken,
        accelerators_pending=pending and taken is None,
        problems=base.problems + problems,
    )


def _take(directory: str, problems: list[tuple[str, str]], now: float) -> Hardware:
    """CPU, memory and disk figures, each part on its own (a failure empties only that part)."""
    cpu_count = cpu_machine = 0
    cpu_model = ""
    try:
        cpu_machine = os.cpu_count() or 0
        try:
            cpu_count = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cpu_count = cpu_machine
        cpu_model = _cpu_model()
    except Exception as exc:
        problems.append(("cpu", _problem(exc)))
    memory_limit: int | None = None
    quota: float | None = None
    try:
        memory_limit, quota = _cgroup_limits()
    except Exception as exc:
        problems.append(("cgroup", _problem(exc)))
    ram_total = ram_available = 0
    try:
        vm = psutil.virtual_memory()
        ram_total, ram_available = int(vm.total), int(vm.available)
    except Exception as exc:
        problems.append(("ram", _problem(exc)))
    disk_path, disk_total, disk_free = "", 0, 0
    if directory:
        try:
            where, disk_total, disk_free = _disk(Path(directory).expanduser())
            disk_path = str(where)
        except Exception as exc:
            problems.append(("disk", _problem(exc)))
    return Hardware(
        cpu_count=cpu_count,
        cpu_count_machine=cpu_machine,
        cpu_model=cpu_model,
        cpu_quota=quota,
        ram_total_bytes=ram_total,
        ram_available_bytes=ram_available,
        memory_limit_bytes=memory_limit,
        data_dir=directory,
        disk_path=disk_path,
        disk_total_bytes=disk_total,
        disk_free_bytes=disk_free,
        gpus=(),
        openvino_devices=(),
        taken_at=now,
        accelerators_taken_at=None,
        problems=tuple(problems),
    )
