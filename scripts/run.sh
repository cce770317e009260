#!/usr/bin/env bash
# Set up .venv at the repo root (re-used when it is current) and run the demo or the tests.
#   bash scripts/run.sh demo     # stock vs planned TP=2, one rank 4x slower; writes runs/demo/plot.png
#   bash scripts/run.sh test     # the default test suite (no slow, no GPU tests)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "colossal-hetero needs Python 3.10 or newer; set PYTHON=/path/to/python3.x" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
# Re-install only when the dependency declaration or the pinned set changed since the last
# install. constraints.txt pins every package to the versions CI tested, so installs do not
# drift when a dependency releases. Lean by default: colossalai without the dependencies its
# training path never imports (scripts/requirements-lean.txt); COLOSSAL_HETERO_FULL_INSTALL=1
# installs colossalai with all of them.
stamp=.venv/.colossal-hetero-installed
lean=scripts/requirements-lean.txt
full=${COLOSSAL_HETERO_FULL_INSTALL:-0}
want=$(cat pyproject.toml constraints.txt "$lean" <(echo "full=$full") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # setuptools warns on every editable build that a folder named like the package could
    # shadow it; that is this checkout, on purpose.
    quiet_build="ignore:Editable installation:UserWarning:setuptools.command.editable_wheel"
    pip=(env PYTHONWARNINGS="$quiet_build" .venv/bin/python -m pip install --quiet -c constraints.txt)
    .venv/bin/python -m pip install --quiet --upgrade pip
    if [ "$full" = 1 ]; then
        "${pip[@]}" -e '.[test]'
    else
        "${pip[@]}" -r "$lean"
        "${pip[@]}" --no-deps colossalai
        "${pip[@]}" --no-deps -e .
    fi
    echo "$want" > "$stamp"
fi

case "${1:-}" in
    demo)
        shift
        exec .venv/bin/colossal-hetero demo "$@"
        ;;
    test)
        shift
        set +e
        .venv/bin/python -m pytest "$@"
        status=$?
        set -e
        # pytest exits 5 when the selection matched no test (e.g. `-k` with no match):
        # say so, and do not report it as a failure.
        if [ "$status" -eq 5 ]; then
            echo "pytest: no tests matched the selection" >&2
            status=0
        fi
        exit "$status"
        ;;
    *)
        echo "usage: bash scripts/run.sh demo|test [args...]" >&2
        exit 2
        ;;
esac
