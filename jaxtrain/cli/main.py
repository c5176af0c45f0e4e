"""`jaxtrain <command> [args]`: one entry point for the programs, the same as their `python -m` forms.

    jaxtrain train --gin_file=default.gin --workdir=runs/first     python -m jaxtrain.train ...
    jaxtrain prepare ...                                           python -m jaxtrain.data prepare ...

Each command's module is imported only when it runs: the programs size the simulated CPU devices
before jax starts, so nothing here may import jax.
"""
from __future__ import annotations

import importlib
import sys

# command -> (module whose main(argv) runs it, arguments put before the user's, what it does)
COMMANDS = {
    "train": ("jaxtrain.cli.train", (), "train or fine-tune a model from gin configs"),
    "prepare": ("jaxtrain.cli.data", ("prepare",), "tokenize text or chat files into a token store"),
    "data": ("jaxtrain.cli.data", (), "token stores: prepare one, or check what one holds (info)"),
    "generate": ("jaxtrain.cli.generate", (), "generate text from a run or a Hugging Face directory"),
    "eval": ("jaxtrain.cli.eval", (), "perplexity of a text file, or lm-evaluation-harness tasks"),
    "convert": ("jaxtrain.cli.convert", (), "import or export Hugging Face checkpoints and PEFT adapters"),
    "plan": ("jaxtrain.cli.plan", (), "rank parallel layouts for a model on a cluster"),
    "bench": ("jaxtrain.cli.bench", (), "time a train step or the collectives of a mesh"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items())
    return (f"usage: jaxtrain <command> [args]   (jaxtrain <command> --help for its flags)\n\ncommands:\n{rows}\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n{usage()}", end="", file=sys.stderr)
        return 2
    module, before, _ = COMMANDS[command]
    code = importlib.import_module(module).main([*before, *rest])
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
