"""``katamgr webhook``: the admission webhook's command."""

from __future__ import annotations

import argparse
import logging

from gpunode.errors import ConfigError

log = logging.getLogger("katamgr")


def cmd_webhook(args: argparse.Namespace) -> int:
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
                    handler_of=_handler_lookup() if args.check_handlers else None)
    server = make_server(args.listen, args.tls_cert_file, args.tls_private_key_file, policy,
                         from_args(args))
    log.warning("katamgr webhook serving on https://%s (runtime classes %s)", args.listen,
                ", ".join(policy.runtime_classes))
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def _handler_lookup():
    from gpunode.services.apiclient import connect
    from katamgr.cluster.handlers import handler_lookup

    api = connect(home_kubeconfig=False)
    if api is None:
        raise ConfigError("--check-handlers reads RuntimeClasses from the API server, but there is no "
                          "in-cluster service account and no KUBECONFIG")
    return handler_lookup(api)
