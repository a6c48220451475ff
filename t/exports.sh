#!/bin/sh
# t/exports.sh -- the shared libepjit exports only the public epj_ prefix,
# and the stand-in CUDA driver (t/fake_cuda.c) only what a real libcuda.so.1
# exports, plus its three test hooks.
#
# Lists the dynamic symbols the built .libs/libepjit.so defines (code and data;
# the linker's own markers such as _init, _fini, _edata, _end, __bss_start are
# ignored) and fails when one does not start with `epj_`, or when there are
# none at all (an empty export list means the version script went wrong).
# Exit 77 (automake's SKIP) when no shared library was built or nm is absent.
# Run by `make check`, which sets top_builddir; by hand: top_builddir=BUILD sh
# t/exports.sh.

lib="${top_builddir:-.}/.libs/libepjit.so"
if [ ! -f "$lib" ]; then
	echo "SKIP: $lib not built (--disable-shared?)"
	exit 77
fi
if ! command -v nm >/dev/null 2>&1; then
	echo "SKIP: nm not found (apt-get install binutils)"
	exit 77
fi

syms=$(nm -D --defined-only "$lib") || {
	echo "FAIL: nm -D --defined-only $lib failed"
	exit 1
}
# "ADDR TYPE NAME"; type A marks absolute symbols (version nodes); drop the
# symbol-version suffix "@@VER" that some linkers print.
names=$(printf '%s\n' "$syms" | awk 'NF >= 3 && $2 != "A" { sub(/@.*/, "", $3); print $3 }' |
	grep -v -E '^(_init|_fini|_edata|_end|__bss_start|__data_start|__dso_handle|_DYNAMIC|_GLOBAL_OFFSET_TABLE_|__gmon_start__|__end__|__bss_end__|__bss_start__|_bss_end__)$' |
	sort -u)

total=$(printf '%s\n' "$names" | grep -c . || true)
if [ "$total" -eq 0 ]; then
	echo "FAIL: $lib exports no symbols at all"
	exit 1
fi
bad=$(printf '%s\n' "$names" | grep -v '^epj_' || true)
if [ -n "$bad" ]; then
	echo "FAIL: $lib exports symbols outside the epj_ prefix:"
	printf '  %s\n' $bad
	exit 1
fi
echo "PASS: $total exported symbols, all epj_*"

# The stand-in driver: cu* names of the Driver API (each one declared in
# cuda.h where the toolkit is installed) and the test hooks
# fake_cuda_set_hook, fake_cuda_device_access and fake_cuda_stream_access,
# nothing else, so that no
# test (and no library code) can lean on a symbol a real driver lacks.
fake="${top_builddir:-.}/t/.libs/libfakecuda.so"
if [ -f "$fake" ]; then
	fnames=$(nm -D --defined-only "$fake" | awk 'NF >= 3 && $2 != "A" { sub(/@.*/, "", $3); print $3 }' |
		grep -v -E '^(_init|_fini|_edata|_end|__bss_start|__data_start|__dso_handle|_DYNAMIC|_GLOBAL_OFFSET_TABLE_|__gmon_start__|__end__|__bss_end__|__bss_start__|_bss_end__)$' |
		sort -u)
	fbad=$(printf '%s\n' "$fnames" |
		grep -v -E '^(cu[A-Z][A-Za-z0-9_]*|fake_cuda_set_hook|fake_cuda_device_access|fake_cuda_stream_access)$' || true)
	if [ -n "$fbad" ]; then
		echo "FAIL: $fake exports symbols a real libcuda.so.1 lacks:"
		printf '  %s\n' $fbad
		exit 1
	fi
	hdr="${EPJ_CUDA_HOME:-/usr/local/cuda}/include/cuda.h"
	if [ -f "$hdr" ]; then
		for n in $(printf '%s\n' "$fnames" | grep '^cu'); do
			# declared, or the target of a #define (cuGetProcAddress_v2)
			grep -q -E "(CUDAAPI ${n}\(|#define +[A-Za-z0-9_]+ +${n}( |\$))" "$hdr" || {
				echo "FAIL: $fake exports $n, which $hdr does not declare"
				exit 1
			}
		done
	fi
	echo "PASS: $fake exports the Driver API and its test hooks only"
fi
exit 0
