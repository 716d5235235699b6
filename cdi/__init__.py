"""Container Device Interface: spec model, validation and spec files."""
