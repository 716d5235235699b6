"""An ``Agent`` made the way a test writes it: the node it keeps, then any setting of
``AgentSettings`` or link of ``NodeLinks`` by name (``katamgr.agent.settings``), so each test
names only what it varies."""

from __future__ import annotations

from dataclasses import fields

from katamgr.agent import Agent
from katamgr.agent.settings import AgentSettings, NodeLinks

_LINKS = {f.name for f in fields(NodeLinks)}


def make_agent(host, naming, steps, ctx, **given) -> Agent:
    links = {name: given.pop(name) for name in list(given) if name in _LINKS}
    return Agent(AgentSettings(host, naming, steps, ctx, **given), NodeLinks(**links))
