#!/bin/sh
# t/layers.sh -- the layers hold: no file includes a header of a layer above
# its own (doc/architecture.md).  lib/ (the eager core) includes only lib/
# headers; jit/ includes lib/ and jit/ (and the templates/ text); kernels/
# includes lib/, jit/ and kernels/; runtime/ includes lib/, jit/, kernels/
# and runtime/.  Every file gets -Ilib -Ijit -Ikernels -Iruntime, so the
# compiler cannot tell; this does, from each quoted #include: a header
# found in a folder above the including file's fails, naming both.
# Generated and configure headers (config.h, jit/build_id.h,
# templates/*_text.h) belong to no layer.  tools/, t/ and bench/ sit on top
# and may include anything.  The runtime uses the jit and the kernels
# through their interface headers, never jit_impl.h (the jit's private
# structures): not directly, and not through a jit or kernels header it
# includes; of kernels/ it includes kernels.h alone.
srcdir=$(cd "${top_srcdir:-.}" && pwd) || exit 1
cd "$srcdir" || exit 1

rank() {
	case $1 in
	lib) echo 1 ;;
	jit | templates) echo 2 ;;
	kernels) echo 3 ;;
	runtime) echo 4 ;;
	*) echo 9 ;;
	esac
}

bad=0 n=0
for layer in lib jit kernels runtime; do
	mine=$(rank "$layer")
	for f in "$layer"/*.c "$layer"/*.h; do
		[ -f "$f" ] || continue
		for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f"); do
			n=$((n + 1))
			case $inc in
			../*) dir=${inc#../}; dir=${dir%%/*} ;;
			*/*) dir=${inc%%/*} ;;
			*)
				dir=
				for d in lib jit kernels runtime; do
					[ -f "$d/$inc" ] && dir=$d && break
				done
				;;
			esac
			[ -n "$dir" ] || continue # config.h: no layer
			case $inc in
			jit/build_id.h | templates/*_text.h) continue ;;
			esac
			if [ "$(rank "$dir")" -gt "$mine" ]; then
				echo "FAIL: $f includes \"$inc\" of $dir/, a layer above $layer/"
				bad=$((bad + 1))
			fi
		done
	done
done
# the jit's private structures stay the jit's
incs() {
	sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$1"
}
for f in runtime/*.c runtime/*.h; do
	for inc in $(incs "$f"); do
		for d in jit kernels; do
			[ -f "$d/$inc" ] || continue
			if [ "$inc" = jit_impl.h ]; then
				echo "FAIL: $f includes jit/jit_impl.h, the jit's private header"
				bad=$((bad + 1))
			elif incs "$d/$inc" | grep -qx 'jit_impl.h'; then
				echo "FAIL: $f includes $d/$inc, which includes jit/jit_impl.h"
				bad=$((bad + 1))
			fi
			if [ "$d" = kernels ] && [ "$inc" != kernels.h ]; then
				echo "FAIL: $f includes kernels/$inc: the runtime uses the kernels through kernels/kernels.h"
				bad=$((bad + 1))
			fi
		done
	done
done
[ "$n" -gt 100 ] || { echo "FAIL: only $n includes read"; exit 1; }
[ "$bad" -eq 0 ] || exit 1
echo "layers: $n includes of lib/, jit/, kernels/, runtime/, none upward," \
	"no jit_impl.h in runtime/, only kernels.h of kernels/"
