"""The node's context (``gpunode.services.nodecontext``) built in a test as each program's main
builds it, on a host the test opened already: from the program's own parser, so a flag a
program lacks fails here as it would on the node."""

from __future__ import annotations

from gpunode.services import nodecontext
from gpunode.services.nodecontext import NodeContext
from gpunode.services.simulator import REAL_NODE


def katamgr_context(host, config=None, *flags: str, extras=REAL_NODE, command: str = "plan") -> NodeContext:
    """As ``katamgr plan``/``apply``/``run`` build it (``config``: the --config file's model)."""
    from katamgr.commands.parser import build_parser
    from katamgr.commands.setup import node_base

    args = build_parser().parse_args([command, "--host-root", str(host.root), *flags])
    return nodecontext.opened(args, host, extras, node_base(config))


def plugin_context(host, *flags: str, extras=REAL_NODE, program: str = "sandbox-device-plugin") -> NodeContext:
    """As ``sandbox-device-plugin`` (or ``sandbox-dra-driver``) builds it."""
    from sandbox_plugin import cli as plugin_cli
    from sandbox_plugin.dra import cli as dra_cli
    from sandbox_plugin.fabricgate import ask_guarded

    parser = plugin_cli.build_parser() if program == "sandbox-device-plugin" else dra_cli.build_parser()
    args = parser.parse_args(["--host-root", str(host.root), *flags])
    return nodecontext.opened(args, host, extras, ask=ask_guarded)


def kata_found(node: NodeContext):
    """The agent's ``KataFound`` as ``katamgr run`` makes it from the context."""
    from katamgr.agent.katafound import KataFound

    return KataFound(node.given.nvswitch_rule, node.containerd_config, node.base.artifacts_dir,
                     node.base.runtime_classes)
