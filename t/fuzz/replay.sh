#!/bin/sh
# t/fuzz/replay.sh -- every fuzz target's replay program over its seed
# corpus (t/fuzz/corpus/<target>/) and its past crashes
# (t/fuzz/crashes/<target>/, kept once fixed).  Run by make check.
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
status=0
for t in safetensors checkpoint ckpt_set ds_config hf_config tokens kcache archive; do
	prog="$builddir/t/fuzz/replay_$t"
	if [ ! -x "$prog" ]; then
		echo "SKIP: $prog not built"
		exit 77
	fi
	if out=$("$prog" "$srcdir/t/fuzz/corpus/$t" "$srcdir/t/fuzz/crashes/$t" 2>&1); then
		echo "PASS: $t: $out"
	else
		echo "FAIL: $t: $out"
		status=1
	fi
done
exit $status
