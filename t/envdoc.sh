#!/bin/sh
# t/envdoc.sh -- every environment variable the library and the man-paged
# tools read is listed in the ENVIRONMENT section of epjit-train(1).
#
# A variable is read when its name is the string literal of a getenv call
# (getenv("NAME")), any "EPJIT_..." string literal (names passed through a
# helper or a macro, e.g. sim_flag("EPJIT_SIM_POISON")), a name the
# trainer setenv()s for a library that reads it, or a literal of a
# `vars[]` table that a loop hands to getenv.  Scanned: lib/, jit/,
# kernels/, runtime/ and the sources of the tools with a man page
# (tools/epjit_*.c).  gpu-check's probe documents its own in its --help.
# A name is listed when the section names it; each item's tag must be
# a variable the code reads (no stale entries).
srcdir=${top_srcdir:-${srcdir:-.}}
page=$srcdir/doc/epjit-train.1
[ -f "$page" ] || { echo "FAIL: no $page"; exit 1; }
srcs=$(ls "$srcdir"/lib/*.c "$srcdir"/lib/*.h "$srcdir"/jit/*.c \
	"$srcdir"/kernels/*.c "$srcdir"/runtime/*.c "$srcdir"/tools/epjit_*.c \
	2>/dev/null)
[ -n "$srcs" ] || { echo "FAIL: no sources under $srcdir"; exit 1; }
tmp=${TMPDIR:-/tmp}/envdoc.$$
trap 'rm -f "$tmp".*' EXIT
# shellcheck disable=SC2086
{
	grep -ho 'getenv("[A-Za-z_][A-Za-z0-9_]*")' $srcs |
		sed 's/getenv("\(.*\)")/\1/'
	grep -ho '"EPJIT_[A-Z0-9_]*"' $srcs | tr -d '"'
	# set for the libraries that read them (OpenMP, OpenBLAS)
	grep -ho 'setenv("[A-Za-z_][A-Za-z0-9_]*"' $srcs |
		sed 's/setenv("\(.*\)"/\1/'
	# the literals of `vars[] = { ... }` tables, up to the closing brace
	awk '/vars\[\] = \{/ { on = 1 } on { print } on && /\};/ { on = 0 }' \
		$srcs | grep -o '"[A-Z_][A-Z0-9_]*"' | tr -d '"'
} | sort -u >"$tmp.read"
sed -n '/^\.SH ENVIRONMENT/,/^\.SH [A-DF-Z]/p' "$page" >"$tmp.sec"
# the item tags: the line after each .TP
awk 'tp { print; tp = 0 } /^\.TP/ { tp = 1 }' "$tmp.sec" |
	sed 's/^\.[A-Z]* //; s/[",]/ /g' | tr ' ' '\n' |
	grep -E '^[A-Z_][A-Z0-9_]+$' | sort -u >"$tmp.tags"
# every name the section mentions (tags and running text)
tr -c 'A-Za-z0-9_' '\n' <"$tmp.sec" | grep -E '^[A-Z_][A-Z0-9_]+$' |
	sort -u >"$tmp.doc"
n=$(wc -l <"$tmp.read")
# the scan itself must find the variables it is known to read
for v in EPJIT_DEVICE EPJIT_SIM_POISON LOCAL_RANK TMPDIR; do
	grep -qx "$v" "$tmp.read" ||
		{ echo "FAIL: the source scan missed $v"; exit 1; }
done
missing=$(comm -23 "$tmp.read" "$tmp.doc")
if [ -n "$missing" ]; then
	echo "FAIL: read by the code but not in $page ENVIRONMENT:"
	echo "$missing" | sed 's/^/  /'
	exit 1
fi
stale=$(comm -13 "$tmp.read" "$tmp.tags")
if [ -n "$stale" ]; then
	echo "FAIL: an item of $page ENVIRONMENT that the code reads nowhere:"
	echo "$stale" | sed 's/^/  /'
	exit 1
fi
echo "ok: all $n environment variables the code reads are in epjit-train(1)"
