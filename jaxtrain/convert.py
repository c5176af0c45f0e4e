"""`python -m jaxtrain.convert`: the program is jaxtrain/cli/convert.py."""
import sys

from jaxtrain.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
