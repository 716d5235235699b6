"""A real Linux kernel to test against: Debian's stock kernel booted under QEMU.

What the real-kernel suite (tests/kernel) needs, and nothing about katamgr itself:

- ``support.kerneltree.fetch_kernel``: the kernel package the apt cache offers for ``linux-image-amd64``
  (Debian 12: ``linux-image-6.1.0-N-amd64``), fetched with ``apt-get download`` into a
  cache outside the repository, unpacked with ``dpkg-deb -x`` (never installed on the
  host) and indexed with ``depmod -b``, so ``modprobe`` in the guest finds its modules;
- ``build_initramfs``: a busybox-static initramfs, made at test time with ``cpio``,
  whose ``/init`` loads the 9p, virtio and overlay modules, mounts the host's ``/``
  (shared read-only over virtio-9p) under a tmpfs overlay and chroots into it, so the
  guest runs the host's Python and the repository's ``.venv`` unchanged;
- ``choose_accel``: KVM when ``/dev/kvm`` can run a stock kernel, TCG otherwise;
- ``boot``: QEMU with the stand-in devices (``Topology``), every wait bounded, the
  guest's serial console kept in a file for the failure message.

Facts used here and where they come from:

- ``-device intel-iommu`` with ``intremap=on`` and ``caching-mode=on`` gives the guest a
  VT-d IOMMU whose mappings a nested VFIO user (the guest's own QEMU) can use, the
  caching mode being what lets the emulator see every mapping; under KVM interrupt
  remapping needs ``kernel-irqchip=split`` (QEMU wiki "Features/VT-d"; the properties:
  ``qemu-system-x86_64 -device intel-iommu,help``);
- each ``pcie-root-port`` is its own IOMMU group behind the emulated VT-d, while the
  functions behind a ``pcie-pci-bridge`` share one with it, since conventional PCI
  requests carry the bridge's requester ID (QEMU docs/pcie.txt and
  docs/pcie_pci_bridge.txt; kernel Documentation/driver-api/vfio.rst, "Groups,
  Devices, and IOMMUs");
- ``-fsdev local,...,multidevs=remap`` keeps inode numbers unique when the shared tree
  spans several host filesystems, ``security_model=none`` passes the host's owners and
  modes through (QEMU manual, "Invocation", the ``-fsdev`` option); the guest mounts it
  with ``trans=virtio,version=9p2000.L`` (kernel Documentation/filesystems/9p.rst),
  ``cache=loose`` for the read-only root;
- the guest gets its initramfs as a newc cpio archive and starts ``rdinit=`` from it
  (kernel Documentation/filesystems/ramfs-rootfs-initramfs.rst);
- devtmpfs creates device nodes without udev (kernel ``CONFIG_DEVTMPFS``, drivers/base/
  Kconfig), so ``/dev/vfio/N`` appears in the guest although no udev runs there.
"""


from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from support.kerneltree import KernelTree, KernelVmError, module_chain, which

# Force an accelerator ("kvm" or "tcg") instead of detecting one.
ACCEL_ENV = "KATAMGR_KERNEL_ACCEL"
# The modules the initramfs loads before it can reach the host's tree (the rest is
# loaded later from that tree with modprobe): 9p over virtio-pci, and overlayfs.
EARLY_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
BUSYBOX = Path("/bin/busybox")
QEMU = "qemu-system-x86_64"


# ---- the initramfs -------------------------------------------------------------


@dataclass(frozen=True)
class GuestCommand:
    """What the guest's init runs once it has chrooted into the host's tree."""

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    # Host dirs the guest writes into, each its own writable 9p share mounted at the
    # same path in the guest (its tag is share<N> in this order).
    writable: tuple[str, ...] = ()
    # Dirs that start empty in the guest, so nothing the host left there (node state,
    # sockets, CDI specs) is seen by the commands under test: a tmpfs on /run, as on
    # any booted system; the others deleted in the overlay (the host keeps them), so
    # the commands may create and remove them as on a node.
    tmpfs: tuple[str, ...] = ("/run",)
    removed: tuple[str, ...] = ("/var/lib/kata-sandbox-manager", "/var/lib/kubelet", "/etc/cdi")


INIT_STARTED = "kernelvm: init started"
INIT_CHROOT = "kernelvm: running the guest command"
INIT_DONE = "kernelvm: guest command exited"


def init_script(tree: KernelTree, modules: Sequence[str], command: GuestCommand) -> str:
    """The initramfs's /init (busybox sh). Every value is quoted by ``_q``."""
    lines = [
        "#!/bin/busybox sh",
        "/bin/busybox --install -s /bin",
        "export PATH=/bin",
        "mount -t proc proc /proc",
        "mount -t sysfs sysfs /sys",
        "mount -t devtmpfs devtmpfs /dev",
        f"echo {_q(INIT_STARTED)} > /dev/ttyS0",
    ]
    lines += [f"insmod /modules/{_q(name)} || echo 'kernelvm: insmod {name} failed'" for name in modules]
    lines += [
        "mkdir -p /lower /rw /newroot",
        # The host's / read-only, page cache on (cache=loose): the tree does not
        # change under the guest while it runs.
        "mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /lower",
        "mount -t tmpfs -o mode=0755 rw /rw",
        "mkdir -p /rw/upper /rw/work",
        "mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot",
        "mount -t proc proc /newroot/proc",
        "mount -t sysfs sysfs /newroot/sys",
        "mount -t devtmpfs devtmpfs /newroot/dev",
        "mkdir -p /newroot/dev/pts /newroot/dev/shm",
        "mount -t devpts devpts /newroot/dev/pts",
        "mount -t tmpfs tmpfs /newroot/dev/shm",
    ]
    for path in command.tmpfs:
        lines += [f"mkdir -p /newroot{_q(path)}", f"mount -t tmpfs -o mode=0755 fresh /newroot{_q(path)}"]
    for path in command.removed:
        lines.append(f"rm -rf /newroot{_q(path)}")
    for index, path in enumerate(command.writable):
        lines += [
            f"mkdir -p /newroot{_q(path)}",
            f"mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share{index} /newroot{_q(path)}",
        ]
    # The unpacked kernel's modules where modprobe (and katamgr) look for them:
    # /lib/modules/$(uname -r) of the guest's root.
    lines += [
        "mkdir -p /newroot/lib/modules",
        f"ln -sfn {_q(str(tree.modules))} /newroot/lib/modules/{_q(tree.release)}",
        "ip link set lo up",
        f"echo {_q(INIT_CHROOT)} > /dev/ttyS0",
    ]
    env = " ".join(_q(f"{k}={v}") for k, v in sorted(command.env.items()))
    argv = " ".join(_q(a) for a in command.argv)
    lines += [
        f"chroot /newroot /usr/bin/env -i -C {_q(command.cwd)} {env} {argv} < /dev/null > /dev/ttyS0 2>&1",
        f'echo "{INIT_DONE} $?" > /dev/ttyS0',
        "sync",
        # Power off rather than return: init exiting panics the kernel.
        "poweroff -f",
    ]
    return "\n".join(lines) + "\n"


def _q(value: str) -> str:
    """Single-quote for busybox sh."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def build_initramfs(tree: KernelTree, command: GuestCommand, into: Path) -> Path:
    """A newc cpio archive (the kernel's initramfs format, Documentation/filesystems/
    ramfs-rootfs-initramfs.rst) with busybox, the early modules and /init."""
    if not BUSYBOX.exists():
        raise KernelVmError(f"{BUSYBOX} is missing: install busybox-static (run: bash .ci/setup)")
    staging = into / "initramfs"
    for sub in ("bin", "dev", "proc", "sys", "modules"):
        (staging / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, staging / "bin" / "busybox")
    names = []
    for ko in module_chain(tree, EARLY_MODULES):
        shutil.copy2(ko, staging / "modules" / ko.name)
        names.append(ko.name)
    init = staging / "init"
    init.write_text(init_script(tree, names, command))
    init.chmod(0o755)
    members = sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
    archive = into / "initramfs.cpio"
    with open(archive, "wb") as out:
        try:
            result = subprocess.run(  # noqa: S603
                ["cpio", "--quiet", "-o", "-H", "newc"], cwd=staging, input="\n".join(members).encode(),
                stdout=out, stderr=subprocess.PIPE, timeout=60, check=False,
            )
        except FileNotFoundError as exc:
            raise KernelVmError("cpio is not installed (run: bash .ci/setup)") from exc
    if result.returncode != 0:
        raise KernelVmError(f"cpio failed: {result.stderr.decode(errors='replace')}")
    return archive


# ---- QEMU ------------------------------------------------------------------------


@dataclass(frozen=True)
class Accel:
    name: str  # "kvm" or "tcg"
    why: str

    @property
    def argv(self) -> list[str]:
        if self.name == "kvm":
            # Interrupt remapping under KVM needs the split irqchip (QEMU's intel-iommu).
            return ["-accel", "kvm", "-cpu", "host", "-machine", "q35,kernel-irqchip=split"]
        return ["-accel", "tcg,thread=multi", "-machine", "q35"]


def choose_accel() -> Accel:
    """KVM when it can run a stock kernel here, else TCG.

    A ``/dev/kvm`` we cannot open, or one served only by ``kvm_pvm`` (the
    Pagetable-based Virtual Machine, which runs only PVM-aware guest kernels and
    not Debian's), means TCG. Otherwise KVM is tried; ``boot`` falls back to TCG
    when the kernel prints nothing under it."""
    forced = os.environ.get(ACCEL_ENV)
    if forced in ("kvm", "tcg"):
        return Accel(forced, f"{ACCEL_ENV}={forced}")
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Accel("tcg", f"/dev/kvm cannot be opened ({exc.strerror})")
    os.close(fd)
    modules = Path("/sys/module")
    if (modules / "kvm_pvm").exists() and not any((modules / m).exists() for m in ("kvm_intel", "kvm_amd")):
        return Accel("tcg", "/dev/kvm is kvm_pvm, which cannot run a stock kernel")
    return Accel("kvm", "/dev/kvm is usable")


# The QEMU ids the guest's health checks name in their monitor requests.
AER_DEVICE = "aer-rng"
UNPLUGGED_DEVICE = "unplugged-rng"


@dataclass(frozen=True)
class Topology:
    """The stand-in PCI devices: QEMU's ``edu`` (1234:11e8, no Linux driver) and
    ``VGA`` (1234:1111, Linux's ``bochs``) each behind its own ``pcie-root-port``
    (own IOMMU group), and an ``edu`` with an ``e1000`` NIC (8086:100e, Linux's
    ``e1000``) behind a ``pcie-pci-bridge`` (one group shared with the NIC); two ``virtio-rng``
    devices (1af4:1044, PCIe with AER, the second without FLR) behind root ports of their own."""

    def argv(self) -> list[str]:
        return [
            "-device", "pcie-root-port,id=rp1,chassis=1,slot=1",
            "-device", "edu,bus=rp1",
            "-device", "pcie-root-port,id=rp2,chassis=2,slot=2",
            "-device", "VGA,bus=rp2",
            "-device", "pcie-root-port,id=rp3,chassis=3,slot=3",
            "-device", "pcie-pci-bridge,id=br3,bus=rp3",
            "-device", "edu,bus=br3,addr=1",
            # No option ROM: the guest boots with -kernel, and the ipxe ROMs are a
            # recommends-only package.
            "-device", "e1000,bus=br3,addr=2,romfile=",
            # Two virtio-rng devices (1af4:1044), each behind its own root port, with an
            # AER capability (virtio-pci's "aer" property; hw/virtio/virtio-pci.c also makes
            # Device Control's error reporting enables writable, pcie_cap_deverr_init, which
            # QEMU sends an error message by: hw/pci/pcie_aer.c, pcie_aer_msg_alldev). The
            # second one is hot-unplugged (device_del) by the health checks.
            "-device", "pcie-root-port,id=rp4,chassis=4,slot=4",
            "-device", f"virtio-rng-pci,id={AER_DEVICE},bus=rp4,aer=on",
            "-device", "pcie-root-port,id=rp5,chassis=5,slot=5",
            "-device", f"virtio-rng-pci,id={UNPLUGGED_DEVICE},bus=rp5,aer=on,x-pcie-flr-init=off",
        ]


@dataclass
class GuestRun:
    accel: Accel
    returncode: int | None
    timed_out: str | None  # why the run was cut short, None when the guest powered off
    console: Path
    boot_s: float | None  # until the initramfs's init ran
    total_s: float
    attempts: list[str] = field(default_factory=list)

    def console_tail(self, lines: int = 60) -> str:
        try:
            text = self.console.read_text(errors="replace")
        except OSError:
            return "(no console output)"
        return "\n".join(text.splitlines()[-lines:])


def monitor_socket(workdir: Path) -> Path:
    """QEMU's QMP socket for a run in ``workdir`` (``guestmonitor.MonitorRelay`` talks to it)."""
    return workdir / "qmp.sock"


def qemu_argv(tree: KernelTree, initramfs: Path, command: GuestCommand, accel: Accel, console: Path,
              topology: Topology, *, memory_mb: int = 1536, cpus: int = 2) -> list[str]:
    argv = [
        QEMU, *accel.argv,
        "-m", str(memory_mb), "-smp", str(cpus),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-chardev", f"file,id=console,path={console}", "-serial", "chardev:console",
        "-device", "intel-iommu,intremap=on,caching-mode=on",
        "-kernel", str(tree.vmlinuz), "-initrd", str(initramfs),
        "-append", " ".join([
            "console=ttyS0", "intel_iommu=on", "iommu=pt",
            # A panic ends the run at once (with -no-reboot QEMU exits).
            "panic=-1", "rdinit=/init",
            "8250.nr_uarts=1",
        ]),
        "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
        "-qmp", f"unix:{monitor_socket(console.parent)},server=on,wait=off",
    ]
    for index, path in enumerate(command.writable):
        argv += [
            "-fsdev", f"local,id=share{index},path={path},security_model=none,multidevs=remap",
            "-device", f"virtio-9p-pci,fsdev=share{index},mount_tag=share{index}",
        ]
    return argv + topology.argv()


def boot(tree: KernelTree, command: GuestCommand, workdir: Path, *, topology: Topology | None = None,
         boot_timeout: float = 90.0, total_timeout: float = 300.0, accel: Accel | None = None) -> GuestRun:
    """Boot the guest, run ``command`` in it, wait for it to power off.

    Bounded twice: the initramfs's init must start within ``boot_timeout`` and the
    whole run end within ``total_timeout``; past either QEMU is killed and the run
    says which. Under KVM a kernel that prints nothing within 15 s is taken for a
    KVM that cannot run it, and the run starts again under TCG."""
    if which(QEMU) is None:
        raise KernelVmError(f"{QEMU} is not installed: install qemu-system-x86 (run: bash .ci/setup)")
    topology = topology or Topology()
    initramfs = build_initramfs(tree, command, workdir)
    accel = accel or choose_accel()
    attempts: list[str] = []
    started = time.monotonic()
    while True:
        console = workdir / f"console-{accel.name}.log"
        run = _boot_once(tree, initramfs, command, accel, console, topology, boot_timeout,
                         total_timeout - (time.monotonic() - started), kernel_deadline=15.0 if accel.name == "kvm" else None)
        attempts.append(f"{accel.name} ({accel.why}): {run.timed_out or 'ran'}")
        if accel.name == "kvm" and run.timed_out and run.timed_out.startswith("no kernel output"):
            accel = Accel("tcg", "the kernel printed nothing under KVM")
            continue
        run.attempts = attempts
        run.total_s = time.monotonic() - started
        return run


def _boot_once(tree, initramfs, command, accel, console, topology, boot_timeout, total_timeout,
               kernel_deadline) -> GuestRun:
    console.write_bytes(b"")
    argv = qemu_argv(tree, initramfs, command, accel, console, topology)
    log = console.with_suffix(".qemu.log")
    started = time.monotonic()
    with open(log, "wb") as qemu_log:
        proc = subprocess.Popen(  # noqa: S603
            argv, stdin=subprocess.DEVNULL, stdout=qemu_log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    boot_s = None
    timed_out = None
    try:
        while proc.poll() is None:
            elapsed = time.monotonic() - started
            text = console.read_bytes()
            if boot_s is None and INIT_STARTED.encode() in text:
                boot_s = elapsed
            if kernel_deadline is not None and not text.strip() and elapsed > kernel_deadline:
                timed_out = f"no kernel output within {kernel_deadline:g} s"
                break
            if boot_s is None and elapsed > boot_timeout:
                timed_out = f"the initramfs did not start within {boot_timeout:g} s"
                break
            if elapsed > total_timeout:
                timed_out = f"the guest did not power off within {total_timeout:g} s"
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            # The whole process group: QEMU starts no children, but be sure.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    if proc.returncode not in (0, None) and timed_out is None:
        qemu_said = log.read_text(errors="replace").strip()
        timed_out = None
        if qemu_said:
            with open(console, "a") as handle:
                handle.write(f"\n[qemu exited {proc.returncode}] {qemu_said}\n")
    return GuestRun(accel, proc.returncode, timed_out, console, boot_s, time.monotonic() - started)
