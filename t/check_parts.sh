#!/bin/sh
# t/check_parts.sh -- the t/check-*.part files name every suite of
# `t/check_epjit --list` exactly once, and nothing else: a suite left out
# of every part would silently never run in make check.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
CHECK="$builddir/t/check_epjit"
if [ ! -x "$CHECK" ]; then
	echo "SKIP: $CHECK not built"
	exit 77
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epjit-parts.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
"$CHECK" --list | sort >"$tmp/all" || exit 1
[ -s "$tmp/all" ] || { echo "check_parts: --list printed nothing"; exit 1; }
sed -e 's/#.*//' "$srcdir"/t/check-*.part | tr -s ' \t' '\n\n' |
	grep -v '^$' | sort >"$tmp/parts"
status=0
dup=$(uniq -d "$tmp/parts")
if [ -n "$dup" ]; then
	echo "check_parts: in more than one part (or twice):" $dup
	status=1
fi
missing=$(sort -u "$tmp/parts" | comm -23 "$tmp/all" -)
if [ -n "$missing" ]; then
	echo "check_parts: in no part (never run by make check):" $missing
	status=1
fi
unknown=$(sort -u "$tmp/parts" | comm -13 "$tmp/all" -)
if [ -n "$unknown" ]; then
	echo "check_parts: not a suite:" $unknown
	status=1
fi
[ $status -eq 0 ] && echo "check_parts: $(wc -l <"$tmp/all") suites, each in one part"
exit $status
