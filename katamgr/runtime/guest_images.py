"""The guest a runtime class's Kata release boots, and its images checked before install.

What each release's Kata reads (facts from Kata's code, checked by tests/kata):

- Kata 3.25: ``kernel`` + ``initrd`` (``configuration-qemu-nvidia-gpu.toml.in`` line 17,
  ``initrd = "@INITRDPATH_NV@"``); its ``hypervisor`` table has no ``kernel_verity_params``
  (``pkg/katautils/config.go``), so a dm-verity image would boot unverified there.
- Kata 3.29: ``kernel`` + EROFS ``image`` (toml.in lines 17, 24) with
  ``kernel_verity_params`` (toml.in line 57; config.go line 96).
- Kata 4.1: the same, plus ``guest_extension_images``, entries of ``name``, ``path`` and
  ``verity_params`` (config.go lines 180-187; names checked by ``isValidExtensionName``,
  lines 1135-1154), cold-plugged as virtio-blk with serial ``extension-<name>``.
- Every release: an ``image`` and an ``initrd`` together are refused (4.1 config.go
  line 1363).

Before an artifact is swapped in (``install_artifact``'s ``check``), every image its Kata
config names with dm-verity parameters (from the config, else from the layer's
``kata-sandbox-manager.io/verity-params`` annotation) has its root hash recomputed
(``katamgr.artifacts.verity``); an EROFS ``image`` or an extension without parameters is
refused, as is a mismatch: the previous install stays as it was. The parameters taken from
annotations are kept in ``.katamgr-verity.json`` for the rendered config.
"""

from __future__ import annotations

import fnmatch
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import tomlkit
from tomlkit.exceptions import TOMLKitError

from gpunode.policy.katarelease import KataRelease
from katamgr.artifacts import katastatic
from katamgr.artifacts.errors import ArtifactError
from katamgr.artifacts.manifest import Layer, Manifest
from katamgr.artifacts.verity import StreamingBlocks, VerityParams, check_image, parse_params
from katamgr.runtime.tomledit import plain

CONFIG_GLOB = "configuration-*.toml"
VERITY_KEY = "kernel_verity_params"
EXTENSIONS_KEY = "guest_extension_images"
PARAMS_FILE = ".katamgr-verity.json"  # under the artifacts' reserved prefix: no layer takes it
_EXTENSION_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # Kata's isValidExtensionName
VERITY_FROM = (3, 29)
EXTENSIONS_FROM = (4, 1)


@dataclass(frozen=True)
class GuestFormat:
    name: str  # "kernel + initrd", "kernel + EROFS image (dm-verity)", ... + " + extensions"
    why: str


def guest_format(release: KataRelease) -> GuestFormat:
    """What the runtime class's Kata release boots, and the Kata source that says so."""
    version = release.version
    if version is None:
        return GuestFormat("what the artifact's Kata config names",
                           "the Kata release is not known (kataVersion, or a shim the agent finds)")
    if version[:2] < VERITY_FROM:
        return GuestFormat("kernel + initrd", f"{release}'s configuration-qemu-nvidia-gpu.toml boots an initrd; "
                           "its config loader has no kernel_verity_params")
    if version[:2] < EXTENSIONS_FROM:
        return GuestFormat("kernel + EROFS image (dm-verity)", f"{release} boots image with kernel_verity_params; "
                           "its config loader has no guest_extension_images")
    return GuestFormat("kernel + EROFS image (dm-verity) + guest extension images",
                       f"{release} boots image with kernel_verity_params and cold-plugs guest_extension_images")


def plan_guest(entry: dict, release: KataRelease) -> str:
    """``plan``'s word on a runtime class's guest: ``entry["guest"]`` set, its line returned."""
    guest = guest_format(release)
    entry["guest"] = {"format": guest.name, "why": guest.why}
    return f"  guest: {guest.name} ({guest.why})"


def release_problems(doc: dict, release: KataRelease, where: str) -> list[str]:
    """Why ``release``'s Kata would not boot the guest the config ``doc`` describes as meant."""
    version = release.version
    problems = []
    for name, table in (doc.get("hypervisor") or {}).items():
        if not isinstance(table, dict):
            continue
        if table.get("image") and table.get("initrd"):
            problems.append(f"{where} [hypervisor.{name}] sets both image and initrd, which Kata refuses; "
                            "the artifact must ship one")
        if version is None:
            continue
        if version[:2] < VERITY_FROM and table.get(VERITY_KEY):
            problems.append(f"{where} [hypervisor.{name}] sets {VERITY_KEY}, which {release} does not read (its image "
                            "would boot unverified); use the artifact built for this release (kernel + initrd)")
        if version[:2] < EXTENSIONS_FROM and table.get(EXTENSIONS_KEY):
            problems.append(f"{where} [hypervisor.{name}] lists {EXTENSIONS_KEY}, which {release} does not read (the "
                            "guest would lack them); use Kata 4.1 or later, or an artifact without extensions")
    return problems


def images_of(table: dict) -> list[tuple[str, str, str, str]]:
    """(label, file name, parameters from the config, extension name or "") of each guest image."""
    found = []
    image = table.get("image")
    if isinstance(image, str) and image:
        found.append(("image", PurePosixPath(image).name, str(table.get(VERITY_KEY) or ""), ""))
    for i, entry in enumerate(table.get(EXTENSIONS_KEY) or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ArtifactError(f"{EXTENSIONS_KEY}[{i}] has no path; each entry needs name, path and verity_params")
        name = str(entry.get("name") or "")
        if not _EXTENSION_NAME.match(name):
            raise ArtifactError(f"{EXTENSIONS_KEY}[{i}] name {name!r} is not ASCII letters, digits, '-' or '_' "
                                "(Kata puts it in the virtio-blk serial and the kernel command line); rename it")
        if any(extension == name for *_, extension in found):
            raise ArtifactError(f"{EXTENSIONS_KEY} lists {name!r} twice; each extension needs its own name (Kata "
                                "gives each its virtio-blk serial extension-<name>)")
        found.append((f"{EXTENSIONS_KEY} {name}", PurePosixPath(entry["path"]).name,
                      str(entry.get("verity_params") or ""), name))
    return found


class GuestCheck:
    """``verify_staged`` for one install, each image's blocks hashed while it downloads (the
    Kata config, fetched first as the smallest file, names the parameters before the images'
    data arrives): ``install_artifact``'s ``check``."""

    def __init__(self) -> None:
        self.config_done = threading.Event()
        self.streams: dict[str, StreamingBlocks] = {}
        self.lock = threading.Lock()
        self.found: dict[str, str] | None = None

    def tap(self, layer: Layer, path: Path) -> StreamingBlocks | None:
        if fnmatch.fnmatch(layer.name, CONFIG_GLOB):
            return None
        stream = StreamingBlocks(lambda: self._params(layer, path.parent))
        self.streams[layer.name] = stream  # a retry's stream replaces the attempt before
        return stream

    def layer_done(self, name: str) -> None:
        if fnmatch.fnmatch(name, CONFIG_GLOB):
            self.config_done.set()

    def _params(self, layer: Layer, staging: Path) -> tuple[bool, VerityParams | None]:
        if not self.config_done.is_set():
            return False, None  # not yet: the stream holds the image's first bytes
        with self.lock:
            if self.found is None:
                try:
                    self.found = {file_name: params for config in staging.glob(CONFIG_GLOB)
                                  for table in (plain(tomlkit.parse(config.read_text())).get("hypervisor") or {}).values()
                                  if isinstance(table, dict) for _, file_name, params, _ in images_of(table)}
                except (OSError, TOMLKitError, ArtifactError, AttributeError):
                    self.found = {}
        try:
            return True, parse_params(self.found.get(layer.name) or layer.verity_params, layer.name)
        except ArtifactError:
            return True, None  # named by the check, with the image's place in the config

    def __call__(self, staging: Path, manifest: Manifest) -> None:
        verify_staged(staging, manifest, self.streams)


def verify_staged(staging: Path, manifest: Manifest, streams: dict[str, StreamingBlocks] | None = None) -> None:
    """The ``check`` of ``install_artifact``: each guest image's dm-verity root hash, in the
    staging dir, before the swap (from ``streams``' blocks hashed during the download where
    they are whole). ArtifactError refuses the install."""
    # Kata's own kata-static tarballs: their guest files beside them, each measured image checked
    # against its root_hash_<variant>.txt whether or not a config here names it
    kata = katastatic.unpack(staging, manifest, "the artifact")
    taken: dict[str, str] = {}
    for file_name, (params, source) in kata.items():
        if not (staging / file_name).is_symlink():
            check_image(staging / file_name, params, f"{file_name} ({source})")
        taken[file_name] = params
    configs = sorted(staging.glob(CONFIG_GLOB))
    if len(configs) != 1:
        _keep(staging, taken)
        return  # no Kata config to read: transform_kata_config names the problem
    try:
        doc = plain(tomlkit.parse(configs[0].read_text()))
    except (OSError, TOMLKitError) as exc:
        raise ArtifactError(f"{configs[0].name} is not valid TOML ({exc}); fix the artifact") from exc
    annotated = {layer.name: layer.verity_params for layer in manifest.layers if layer.verity_params} | taken
    for name, table in (doc.get("hypervisor") or {}).items():
        if not isinstance(table, dict):
            continue
        for label, file_name, params, _ in images_of(table):
            what = f"[hypervisor.{name}] {label} ({file_name})"
            params = params or annotated.get(file_name, "")
            path = staging / file_name
            if not path.is_file():
                continue  # transform_kata_config names a missing file
            if not params:
                if label == "image" and table.get("rootfs_type") != "erofs":
                    continue  # an ext4/xfs image of a release before dm-verity: nothing to check against
                raise ArtifactError(f"{what} has no dm-verity parameters in the config ({VERITY_KEY} / verity_params) "
                                    "nor in its layer's kata-sandbox-manager.io/verity-params annotation; an "
                                    "unverified guest image is not installed")
            if file_name not in kata:  # a Kata tarball's image was checked above
                check_image(path, params, what, (streams or {}).get(file_name))
            if file_name in annotated:
                taken[file_name] = params
    _keep(staging, taken)


def _keep(staging: Path, taken: dict[str, str]) -> None:
    if taken:
        (staging / PARAMS_FILE).write_text(json.dumps(taken, indent=2, sort_keys=True) + "\n")


def annotated_params(artifact_dir: Path) -> dict[str, str]:
    """File name -> dm-verity parameters the install took from layer annotations."""
    try:
        found = json.loads((Path(artifact_dir) / PARAMS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
