"""The `taperfold` command line. Thin: each command parses options and calls the library."""

from __future__ import annotations

import json
import sys

import click

from taperfold.errors import NumericMismatch, TaperfoldError


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="taperfold")
def cli() -> None:
    """Export, fold, verify and benchmark transformers trained with TaperNorm.

    \b
    Typical flow:
      taperfold train --preset tiny --out tiny.pt
      taperfold export tiny.pt --onnx -o out/
      taperfold verify out/
      taperfold bench out/ --engine ort
    """


# ---- commands are registered below, one section per command --------------------------------------


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("taperfold: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if e.exit_code == 2 else e.exit_code)
    except TaperfoldError as e:
        click.echo(f"taperfold: error: {e}", err=True)
        sys.exit(e.exit_code)
    except NumericMismatch as e:
        click.echo(f"taperfold: FAILED: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("taperfold: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
