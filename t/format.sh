#!/bin/sh
# t/format.sh -- every C source of the tree is clang-format clean.
#
# Checks the *.c and *.h files under lib/ runtime/ jit/ kernels/ tools/ t/
# bench/ that git tracks or that are untracked but not ignored (in a tarball
# without .git: every such file) with `clang-format --dry-run -Werror`
# against the repo's .clang-format.  Fails (exit 1) listing the files that
# are not clean; exit 77 (SKIP) when clang-format is absent.  Works from a
# VPATH build: the sources are found through $top_srcdir, which `make check`
# sets.
# Fix a file with: clang-format -i FILE (from the source tree).

srcdir="${top_srcdir:-.}"
if ! command -v clang-format >/dev/null 2>&1; then
	echo "SKIP: clang-format not found (apt-get install clang-format)"
	exit 77
fi
cd "$srcdir" || exit 1
if [ ! -f .clang-format ]; then
	echo "FAIL: no .clang-format in $srcdir"
	exit 1
fi

dirs="lib runtime jit kernels tools t bench"
list=
# git only when $srcdir is the top of a work tree: a tarball unpacked inside
# another checkout (make distcheck in a build folder) is not that checkout.
if command -v git >/dev/null 2>&1 &&
	git rev-parse --is-inside-work-tree >/dev/null 2>&1 &&
	[ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
	# Pathspec '*' also matches '/', so subfolders are included.
	list=$(git ls-files --cached --others --exclude-standard -- \
		'lib/*.[ch]' 'runtime/*.[ch]' 'jit/*.[ch]' 'kernels/*.[ch]' \
		'tools/*.[ch]' 't/*.[ch]' 'bench/*.[ch]' | sort -u)
else
	for d in $dirs; do
		[ -d "$d" ] || continue
		list="$list
$(find "$d" -type f \( -name '*.c' -o -name '*.h' \) | sort)"
	done
fi

n=0
bad=
for f in $list; do
	[ -f "$f" ] || continue # tracked but deleted in the work tree
	n=$((n + 1))
	if ! clang-format --dry-run -Werror "$f" >/dev/null 2>&1; then
		bad="$bad $f"
	fi
done
if [ "$n" -eq 0 ]; then
	echo "FAIL: no C sources found under $dirs in $srcdir"
	exit 1
fi
if [ -n "$bad" ]; then
	echo "FAIL: not clang-format clean (fix: clang-format -i FILE):"
	for f in $bad; do
		echo "  $f"
	done
	# Show the first offender's diff to make the problem obvious.
	set -- $bad
	clang-format --dry-run "$1" 2>&1 | head -n 20
	exit 1
fi
echo "PASS: $n files clang-format clean"
exit 0
