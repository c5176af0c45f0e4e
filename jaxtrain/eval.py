"""`python -m jaxtrain.eval`: the program is jaxtrain/cli/eval.py."""
import sys

from jaxtrain.cli.eval import main

if __name__ == "__main__":
    sys.exit(main())
