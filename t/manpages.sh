#!/bin/sh
# t/manpages.sh -- each tool's --help and its man page name the same
# options: every option --help prints is in the man page's SYNOPSIS or is
# the tag of one of its items (.TP), and every option of the SYNOPSIS and
# of the items is one --help prints.  A flag added to a tool without its
# manual entry, or a manual entry for a flag that is gone, fails here.
srcdir=${top_srcdir:-${srcdir:-.}}
bindir=${top_builddir:-.}/tools
fail=0
# options of a man page: SYNOPSIS lines and the line after each .TP
man_opts() {
	awk '/^\.SH/ { syn = ($2 == "SYNOPSIS") ; next }
	     syn { print }
	     tp { print; tp = 0 }
	     /^\.TP/ { tp = 1 }' "$1" | sed 's/\\-/-/g' |
		grep -o -- '--[a-z][a-z0-9-]*' | sort -u
}
for t in train warmup dump ckpt; do
	page=$srcdir/doc/epjit-$t.1
	exe=$bindir/epjit-$t
	[ -f "$page" ] || { echo "FAIL: no $page"; fail=1; continue; }
	[ -x "$exe" ] || { echo "FAIL: no $exe"; fail=1; continue; }
	"$exe" --help >help.$$ 2>&1 || { echo "FAIL: epjit-$t --help exited $?"; fail=1; }
	grep -o -- '--[a-z][a-z0-9-]*' help.$$ | sort -u >h.$$
	man_opts "$page" >m.$$
	if ! cmp -s h.$$ m.$$; then
		echo "FAIL: epjit-$t: --help (<) and $page (>) differ:"
		diff h.$$ m.$$ | grep '^[<>]'
		fail=1
	else
		echo "ok: epjit-$t: $(wc -l <h.$$) options in --help and the man page"
	fi
	rm -f help.$$ h.$$ m.$$
done
exit $fail
