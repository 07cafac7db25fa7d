"""`sluice serve [MODEL]`: manage.py serve, with the model as an optional positional argument."""

import argparse

from controlplane.management.commands import serve


class ServeCommand(serve.Command):
    def add_arguments(self, parser) -> None:
        super().add_arguments(parser)
        # Suppressed when absent, so serve's --model (and its default) stands.
        parser.add_argument(
            "model",
            nargs="?",
            default=argparse.SUPPRESS,
            metavar="MODEL",
            help="a packaged model or a model directory (--model)",
        )

    def parse_options(self, argv: list[str]) -> argparse.Namespace:
        """serve's options in `argv`; a bad one ends the command with argparse's usage and error."""
        self._called_from_command_line = True  # else Django's parser raises a CommandError, a traceback here
        return self.create_parser("sluice", "serve").parse_args(argv)
