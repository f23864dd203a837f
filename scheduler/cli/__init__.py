"""The ``pdlife`` command: the parser, shared subcommand records, one module per
subcommand."""
