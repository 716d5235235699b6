"""How katamgr's commands print: tables that fit the terminal, versioned JSON/YAML
documents, progress lines. Pure functions of plans, reports and records; the commands
(``katamgr.cli``, through ``katamgr.render``) choose the stream."""
