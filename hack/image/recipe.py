"""What the image of kata-sandbox-manager is: the one recipe, for every architecture.

hack/image/build carries it out (build.py); nothing else builds this image, and there is no
Dockerfile: the image the tests run is the image a release publishes.

One image holds every command (`katamgr`, the entrypoint; `sandbox-device-plugin`;
`sandbox-dra-driver`): Debian bookworm made by mmdebstrap (minbase, merged /usr, no manuals,
translations or docs beyond the copyright files), the Debian packages below, and a
virtualenv in VENV_DIR holding this package as a regular wheel with exactly the versions of
its runtime dependencies that .venv has (what the tests ran), installed offline from a
wheelhouse fetched for the image's Python and architecture, every dependency's wheel by the
sha256 requirements/image.lock gives it (hack/image/lock writes that from .venv).

Runs as root on purpose. Binding GPUs to vfio-pci writes root-only sysfs files and loads a
kernel module, and the agent edits root-owned containerd and Kata files on the host; no
unprivileged user can do that. The Helm chart confines the rights instead: only the katamgr
container is privileged, and only while vfioManager is enabled; the device plugin runs with
every capability dropped and a read-only root filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass

SUITE = "bookworm"
DEBS = (
    "python3",  # the virtualenv's interpreter (3.11: PYTHON below)
    "hwdata",  # pci.ids, for model-named resources (GA102GL [A10] -> nvidia.com/GA102GL_A10)
    "kmod",  # modprobe, to load vfio-pci from the host's /lib/modules
    "libudev1",  # what pyudev reads the kernel's device events (uevents) through
    "ca-certificates",  # TLS to registries (Kata artifacts) and the API server
    "zstd",  # Kata's own guest artifacts are kata-static-<target>.tar.zst (katamgr.artifacts.katastatic)
)
# bookworm's python3 and glibc: the wheelhouse holds CPython 3.11 wheels for manylinux
# glibc 2.36 or older, whatever the building machine runs.
PYTHON = (3, 11)
GLIBC = (2, 36)
VENV_DIR = "/opt/kata-sandbox-manager"
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Like Debian's slim images: no manuals, translations or docs beyond the copyright files.
DPKG_OPTS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/lintian/*",
)


@dataclass(frozen=True)
class Platform:
    """An architecture the image is built for, by the names each tool uses for it."""

    arch: str  # Debian's and OCI's (GOARCH too)
    variant: str | None  # OCI's platform variant
    machine: str  # uname -m, PEP 508 platform_machine, the manylinux tags' suffix
    elf_machine: int  # e_machine of its ELF files
    oldest_manylinux: int  # the first glibc 2.x with manylinux wheels for it

    @property
    def name(self) -> str:
        return f"linux/{self.arch}" + (f"/{self.variant}" if self.variant else "")

    def oci(self) -> dict[str, str]:
        out = {"architecture": self.arch, "os": "linux"}
        if self.variant:
            out["variant"] = self.variant
        return out

    def wheel_platforms(self) -> list[str]:
        """The wheel platform tags the image's Python takes, newest first: pip's --platform
        takes no range, so every manylinux_2_N up to GLIBC, and the old aliases."""
        major, newest = GLIBC
        tags = [f"manylinux_{major}_{minor}_{self.machine}"
                for minor in range(newest, self.oldest_manylinux - 1, -1)]
        aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags += [f"{alias}_{self.machine}" for minor, alias in aliases.items()
                 if minor >= self.oldest_manylinux]
        return tags

    def marker_environment(self) -> dict[str, str]:
        """PEP 508 markers as the image's Python evaluates them (not the building one)."""
        version = ".".join(map(str, PYTHON))
        return {"implementation_name": "cpython", "platform_python_implementation": "CPython",
                "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
                "platform_machine": self.machine, "python_version": version,
                "python_full_version": f"{version}.2", "implementation_version": f"{version}.2"}


PLATFORMS = {
    "amd64": Platform("amd64", None, "x86_64", 62, 5),
    "arm64": Platform("arm64", "v8", "aarch64", 183, 17),  # NVIDIA Grace
}


def container_config(version: str) -> dict:
    """The image config's `config`: what a runtime starts the container with."""
    return {
        "Env": [f"PATH={VENV_DIR}/bin:{DEBIAN_PATH}", "PYTHONUNBUFFERED=1",
                "PYTHONDONTWRITEBYTECODE=1"],
        "Labels": {
            "org.opencontainers.image.title": "kata-sandbox-manager",
            "org.opencontainers.image.description":
                "Kata Containers with VFIO GPU passthrough for Kubernetes GPU nodes",
            "org.opencontainers.image.licenses": "Apache-2.0",
            "org.opencontainers.image.version": version,
        },
        "Entrypoint": ["katamgr"],
    }


# mmdebstrap's --customize-hook, run once the Debian packages are in: $1 is the new root.
# For a foreign architecture every command in the chroot runs under qemu-user (binfmt).
HOOK = r"""#!/bin/sh
set -eu
root="$1"
chroot "$root" python3 -m venv --without-pip {venv}
# pip runs from its wheel: the image gets no pip. Offline: only the wheelhouse, which holds
# the wheels of this architecture (and pure ones). SOURCE_DATE_EPOCH makes pip's .pyc files
# hash-based (no mtimes in them). A clean environment and no config file: the building
# machine's pip settings (PIP_FIND_LINKS, PIP_INDEX_URL, a pip.conf) have no say in what
# the image installs.
pip_install() {{
    chroot "$root" env -i PATH={path} SOURCE_DATE_EPOCH={epoch} PIP_CONFIG_FILE=/dev/null \
        PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
        {venv}/bin/python /tmp/wheels/{pip_wheel}/pip install -q --no-index \
        --no-warn-script-location "$@"
}}
# Every dependency from the lock, by hash: pip refuses a file whose sha256 the lock does not
# list, and --no-deps resolves nothing beyond it (the lock is the whole closure; build.py
# checked the wheelhouse against it already, this is pip's own word on what it installs).
pip_install --find-links /tmp/wheels --require-hashes --no-deps -r /tmp/wheels/lock/{lock}
# Then the package, built from this tree (no file to pin), alone in its directory: pip finds
# its requirements met by the locked ones, and with no index and no other wheel to take, one
# the lock lacks fails here. By name, as before: a path would make pip record it (PEP 610's
# direct_url.json).
pip_install --find-links /tmp/wheels/project 'kata-sandbox-manager=={version}'
for command in {commands}; do
    chroot "$root" env PYTHONDONTWRITEBYTECODE=1 {venv}/bin/$command --help >/dev/null
done
rm -rf "$root/tmp/wheels" "$root/root/.cache"
# What the dpkg path-excludes keep out of later installs, out of the packages that
# mmdebstrap unpacked before they applied too.
find "$root/usr/share/doc" -mindepth 3 ! -type d -delete
find "$root/usr/share/doc" -mindepth 2 -maxdepth 2 ! -type d ! -name copyright -delete
find "$root/usr/share/doc" -mindepth 2 -type d -empty -delete
rm -rf "$root/usr/share/man/"* "$root/usr/share/info/"* "$root/usr/share/lintian/"*
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {{}} +
# Clamp every mtime to SOURCE_DATE_EPOCH here, as the layer will, and recompile the
# timestamp-based .pyc files of the Python sources whose mtime that changed, so none
# is stale in the image (a stale one is recompiled in memory at every start).
find "$root" -xdev \( -path "$root/proc" -o -path "$root/sys" -o -path "$root/dev" \) -prune \
    -o -newermt "@{epoch}" -print0 >"$root/tmp/clamped"
xargs -0r touch --no-dereference --date="@{epoch}" <"$root/tmp/clamped"
tr '\0' '\n' <"$root/tmp/clamped" | sed -n "s|^$root\(/usr/lib/python3[^ ]*\.py\)$|\1|p" \
    | chroot "$root" python3 -m compileall -q -i - >/dev/null
rm -f "$root/tmp/clamped"
"""


def hook(epoch: int, pip_wheel: str, version: str, lock: str, commands: list[str]) -> str:
    """The hook for ``commands``: every console script the package installs is run (--help)
    in the new root, under emulation for a foreign architecture, and an image that cannot
    start one is not cached. The build stages the wheelhouse in /tmp/wheels, the lock (and
    the files it includes) in /tmp/wheels/lock and the package's wheel in /tmp/wheels/project."""
    return HOOK.format(venv=VENV_DIR, path=DEBIAN_PATH, epoch=epoch, pip_wheel=pip_wheel,
                       version=version, lock=lock, commands=" ".join(commands))


# Left out of the layer: what the container runtime provides (mount points stay, empty),
# apt's package lists, the host's name and resolver, and dpkg's and debconf's
# backups.
DROP_CONTENT = ("dev", "proc", "sys", "run", "tmp", "var/lib/apt/lists", "root/.cache")
DROP_FILES = ("etc/hostname", "etc/resolv.conf", "var/lib/dpkg/status-old",
              "var/lib/dpkg/diversions-old", "var/lib/dpkg/statoverride-old",
              "var/cache/debconf/config.dat-old", "var/cache/debconf/templates.dat-old")


def layer_skip(arc: str) -> bool:
    if arc in DROP_FILES:
        return True
    return any(arc.startswith(d + "/") for d in DROP_CONTENT)


def history(version: str) -> str:
    return (f"hack/image/build: mmdebstrap {SUITE} minbase + {' '.join(DEBS)}; "
            f"{VENV_DIR} with kata-sandbox-manager {version}")
