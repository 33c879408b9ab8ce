"""Click groups whose sub-commands live in modules imported on first use.

`podgate --help` and the forwarders started inside pods (`podgate agent forward`) must not pay
for the gateway, the runtime, gRPC or protobuf.
"""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """`lazy`: name -> (module, attribute, one-line help shown by --help)."""

    def __init__(self, *args: object, lazy: dict[str, tuple[str, str, str]], **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*self.lazy, *super().list_commands(ctx)])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.lazy:
            return super().get_command(ctx, cmd_name)
        module, attr, _ = self.lazy[cmd_name]
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listed from the tables: showing help must not import every sub-command.
        rows = [(name, self.lazy[name][2]) for name in self.lazy]
        for name in super().list_commands(ctx):
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str()))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))
