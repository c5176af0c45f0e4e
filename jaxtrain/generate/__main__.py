"""`python -m jaxtrain.generate`: the program is jaxtrain/cli/generate.py."""
import sys

from jaxtrain.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
