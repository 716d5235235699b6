"""The ``katamgr`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from katamgr import __version__
from katamgr.apply import Report, apply_host, revert_host
from katamgr.errors import ConfigError, KatamgrError
from katamgr.host.errors import HostError
from katamgr.host.pciids import PciIds, validate_alias
from katamgr.host.profile import ProfileError
from katamgr.host.root import HostRoot
from katamgr.host.simulate import materialise
from katamgr.plan import Naming, build_plan
from katamgr.profiles import find_profile, shipped_names
from katamgr.render import plan_text

log = logging.getLogger("katamgr")

DESCRIPTION = """\
Turn a Kubernetes GPU node into a safe host for Kata Containers with whole GPUs
passed through by VFIO: bind NVIDIA GPUs (with their companion functions) and
NVSwitches to vfio-pci one IOMMU group at a time, and undo it exactly.

Start with `katamgr demo` (a simulated DGX-H100-like node, nothing on this
machine is touched), then `katamgr plan --host dgx-h100`.
"""

EPILOG = """\
exit codes: 0 success, 1 failure (the host is left as it was or rolled back),
2 bad usage or configuration (nothing was changed).
shipped host profiles: {profiles}
"""


def _common(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--host-root", default="/", metavar="DIR",
                       help="where the node's filesystem is mounted (default /; /host in the DaemonSet)")
    where.add_argument("--host", metavar="PROFILE",
                       help="simulate PROFILE (a file or a shipped profile name) in a temp dir and work on that")
    parser.add_argument("--pci-ids", metavar="FILE",
                        help="pci.ids database for model names (default: /usr/share/hwdata/pci.ids)")
    parser.add_argument("--alias", metavar="NAME",
                        help="advertise every GPU as nvidia.com/NAME (e.g. pgpu) instead of model names")
    parser.add_argument("--nvswitch-alias", metavar="NAME",
                        help="advertise every NVSwitch as nvidia.com/NAME instead of model names")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every step")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="katamgr", description=DESCRIPTION,
        epilog=EPILOG.format(profiles=", ".join(shipped_names())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"katamgr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="show what apply would change (read-only)",
                       description="Show what `katamgr apply` would change on the node. Reads only.")
    _common(p)
    p.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")
    p.add_argument("--force", action="store_true", help="plan as if --force were given to apply")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="bind GPUs to vfio-pci and write readiness files",
                       description="Carry out the plan: bind each viable IOMMU group of GPUs/NVSwitches "
                                   "(with companions) to vfio-pci, then write /run/nvidia/validations files. "
                                   "Running it again changes nothing.")
    _common(p)
    p.add_argument("--force", action="store_true",
                   help="unbind GPUs even while a process holds /dev/nvidiaN (that workload will crash)")
    p.add_argument("--wait", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for /dev/vfio/<group> after binding (default 5)")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("revert", help="put every device back on the driver it had",
                       description="Undo apply: every device katamgr moved goes back to its recorded driver; "
                                   "readiness files are removed. Devices that were on vfio-pci before stay there.")
    _common(p)
    p.set_defaults(func=cmd_revert)

    p = sub.add_parser("simulate", help="materialise a host profile as a host root",
                       description="Write a simulated node (sysfs shape, /dev/vfio, /proc) for PROFILE into DIR; "
                                   "use it with --host-root DIR. Binding writes there are answered by an emulated kernel.")
    p.add_argument("profile", metavar="PROFILE", help=f"a profile file or one of: {', '.join(shipped_names())}")
    p.add_argument("--into", required=True, metavar="DIR", help="a new or empty directory")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_simulate, host=None, host_root=None)

    p = sub.add_parser("demo", help="run the whole job on a simulated DGX-H100-like node",
                       description="Simulate a DGX-H100-like node in a temp dir, plan, apply, apply again, "
                                   "revert, and print a short report. Touches nothing on this machine.")
    p.add_argument("--profile", default="dgx-h100", help="host profile to simulate (default dgx-h100)")
    p.add_argument("--keep", metavar="DIR", help="simulate into DIR and leave it there to look at")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_demo, host=None, host_root=None)
    return parser


@contextlib.contextmanager
def host_from(args: argparse.Namespace) -> Iterator[HostRoot]:
    if getattr(args, "host", None):
        profile = find_profile(args.host)
        with tempfile.TemporaryDirectory(prefix=f"katamgr-{profile.name}-") as tmp:
            log.info("simulating host profile %s in %s", profile.name, tmp)
            yield materialise(profile, Path(tmp) / "host")
        return
    root = Path(args.host_root)
    if not root.is_dir():
        raise ConfigError(f"--host-root {root} is not a directory; pass the path where the node's / is mounted")
    yield HostRoot.at(root)


def naming_from(args: argparse.Namespace) -> Naming:
    try:
        alias = validate_alias(args.alias) if args.alias else None
        nvswitch_alias = validate_alias(args.nvswitch_alias) if args.nvswitch_alias else None
        pci_ids = PciIds.find(args.pci_ids)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from exc
    return Naming(pci_ids, alias, nvswitch_alias)


def print_report(report: Report, nothing: str) -> None:
    for change in report.changes:
        print(f"changed: {change}")
    for warning in report.warnings:
        print(f"warning: {warning}")
    for failure in report.failures:
        print(f"error: {failure}", file=sys.stderr)
    if not report.changes and not report.failures:
        print(nothing)


def cmd_plan(args: argparse.Namespace) -> int:
    naming = naming_from(args)
    with host_from(args) as host:
        plan = build_plan(host, naming, force=args.force)
        if args.output == "json":
            print(json.dumps(plan.to_json(), indent=2))
        else:
            print(plan_text(plan))
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    naming = naming_from(args)
    with host_from(args) as host:
        plan = build_plan(host, naming, force=args.force)
        report = apply_host(host, plan, wait=args.wait)
        for problem in plan.problems:
            report.warnings.append(problem)
        print_report(report, "nothing to change: the node is already as planned")
    return 0 if report.ok else 1


def cmd_revert(args: argparse.Namespace) -> int:
    with host_from(args) as host:
        report = revert_host(host)
        print_report(report, "nothing to revert: katamgr has no changes recorded on this node")
    return 0 if report.ok else 1


def cmd_simulate(args: argparse.Namespace) -> int:
    profile = find_profile(args.profile)
    host = materialise(profile, args.into)
    print(f"simulated {profile.name} ({len(profile.devices)} PCI devices) in {host.root}")
    print(f"try: katamgr plan --host-root {host.root}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from katamgr.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except (ConfigError, ProfileError, FileExistsError) as exc:
        print(f"katamgr: {exc}", file=sys.stderr)
        return 2
    except (KatamgrError, HostError) as exc:
        print(f"katamgr: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
