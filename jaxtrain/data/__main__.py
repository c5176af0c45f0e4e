"""`python -m jaxtrain.data`: the program is jaxtrain/cli/data.py."""
import sys

from jaxtrain.cli.data import main

if __name__ == "__main__":
    sys.exit(main())
