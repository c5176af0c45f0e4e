"""`python -m jaxtrain.plan`: the program is jaxtrain/cli/plan.py."""
import sys

from jaxtrain.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
