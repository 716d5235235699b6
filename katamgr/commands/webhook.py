"""``katamgr webhook``: the admission webhook's command."""

from __future__ import annotations

import argparse
import logging

from gpunode.errors import ConfigError

log = logging.getLogger("katamgr")


def cmd_webhook(args: argparse.Namespace) -> int:
    from katamgr.admission.hostpaths import control_points
    from katamgr.admission.limits import from_args
    from katamgr.admission.rules import (
        DEFAULT_GPU_HANDLERS,
        DEFAULT_KATA_HANDLERS,
        DEFAULT_PASSTHROUGH,
        DEFAULT_RUNTIME_CLASSES,
        Policy,
    )
    from katamgr.admission.server import make_server

    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)
    policy = Policy(runtime_classes=tuple(args.runtime_class or DEFAULT_RUNTIME_CLASSES),
                    passthrough=tuple(args.passthrough_resource or DEFAULT_PASSTHROUGH),
                    inject_runtime_class=args.inject_runtime_class,
                    confidential_classes=tuple(args.confidential_runtime_class or ()),
                    kata_handlers=tuple(args.kata_handler or DEFAULT_KATA_HANDLERS),
                    gpu_handlers=tuple(args.kata_gpu_handler or DEFAULT_GPU_HANDLERS),
                    handler_of=_handler_lookup() if args.check_handlers else None,
                    dra=_dra_checks(args) if args.dra_driver else None,
                    control_points=control_points(args.kubelet_dir))
    server = make_server(args.listen, args.tls_cert_file, args.tls_private_key_file, policy,
                         from_args(args))
    log.warning("katamgr webhook serving on https://%s (runtime classes %s)", args.listen,
                ", ".join(policy.runtime_classes))
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _api(flag: str, what: str):
    from gpunode.services.apiclient import connect

    api = connect(home_kubeconfig=False)
    if api is None:
        raise ConfigError(f"{flag} reads {what} from the API server, but there is no "
                          "in-cluster service account and no KUBECONFIG")
    return api


def _handler_lookup():
    from katamgr.cluster.handlers import handler_lookup

    return handler_lookup(_api("--check-handlers", "RuntimeClasses"))


def _dra_checks(args: argparse.Namespace):
    from katamgr.admission.draclaims import DraChecks
    from katamgr.cluster.claimreads import claim_reads

    driver = args.dra_driver
    classes = tuple(args.dra_device_class or (f"gpu.{driver}", f"nvswitch.{driver}"))
    claim_of, template_of, pod_of = claim_reads(
        _api("--dra-driver", "ResourceClaims, ResourceClaimTemplates and Pods"))
    return DraChecks(driver, classes, claim_of, template_of, pod_of)
