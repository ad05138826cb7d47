#!/usr/bin/env bash
# Builds the previous release's `control-plane` and `node-agent` (which is also its own
# workload shim) for the rolling-upgrade test, from this repository's own history.
#
#   tests/upgrade/build-previous-release.sh COMMIT OUT_DIR
#
# The commit's tree goes to OUT_DIR/src-<full hash> (`git archive`, so the clone's worktrees and
# index are left alone) and is built with its own Cargo.lock into OUT_DIR/target, a target
# directory of its own: the old binaries never overwrite the new ones, and a second run is a
# no-op build. The last line of stdout is the directory holding the two binaries.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 COMMIT OUT_DIR" >&2
    exit 2
fi
commit=$1
mkdir -p "$2"
out=$(cd "$2" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)

# A shallow clone (CI's default depth of 1) lacks the previous release: say so and how to fix
# it, rather than skipping the test.
if ! full=$(git -C "$repo" rev-parse --verify --quiet "$commit^{commit}"); then
    cat >&2 <<MSG
error: the previous release, commit $commit (named in tests/upgrade/PREVIOUS_RELEASE), is not
in the git repository at $repo, so the rolling-upgrade test cannot build its binaries.
A shallow clone lacks it: run \`git fetch --unshallow\` (or clone without --depth; in GitHub
Actions set \`fetch-depth: 0\` on actions/checkout). If the history was rewritten, name the
last released commit in tests/upgrade/PREVIOUS_RELEASE.
MSG
    exit 3
fi

src="$out/src-$full"
# The marker is written last, so an interrupted extraction is redone rather than built.
if [ ! -e "$src/.extracted" ]; then
    rm -rf "$src"
    mkdir -p "$src"
    git -C "$repo" archive --format=tar "$full" | tar -x -C "$src"
    touch "$src/.extracted"
fi

# From inside the old tree, so that a rust-toolchain file there would be honoured. Run from
# a test, the outer cargo's variables must not leak in: its target directory, and the
# package variables it sets for the test (CARGO_PKG_NAME and the like), which the inner
# cargo compares with what it compiled with, rebuilding on every switch between a run by
# hand and a run from the test.
for v in $(compgen -e | grep -E '^CARGO_(PKG_|MANIFEST_|CRATE_|BIN_|PRIMARY_PACKAGE$|TARGET_DIR$|TARGET_TMPDIR$)'); do
    unset "$v"
done
unset CARGO_BUILD_TARGET_DIR
cd "$src"
cargo build --locked --target-dir "$out/target" \
    -p control-plane -p node-agent --bin control-plane --bin node-agent >&2
echo "$out/target/debug"
