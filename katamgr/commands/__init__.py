"""The ``katamgr`` subcommands, one module per job; ``katamgr.cli`` parses and dispatches."""
