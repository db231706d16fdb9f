"""`atomrt bench` subcommands."""
