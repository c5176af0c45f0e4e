"""Not code: this file makes `configs` a regular package so that gin's package-path file reader,
which gin tries for `include 'configs/x.gin'` when the repo root is on sys.path (tests,
notebooks), resolves it here instead of failing on a namespace package."""
