#!/bin/sh
# t/fuzz/build.sh OUT -- builds the libFuzzer version of every fuzz target
# into OUT.  The library is built for it in OUT/tree (configured once):
# clang, --enable-sanitizers (ASan + UBSan) and -fsanitize=fuzzer-no-link, so
# that libFuzzer sees the coverage of the readers themselves, not only of the
# target files.  Then t/fuzz/run.sh OUT [SECONDS].
set -eu
out=$(mkdir -p "${1:?usage: build.sh OUT}" && cd "$1" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
tree="$out/tree"
mkdir -p "$tree"
if [ ! -f "$tree/Makefile" ]; then
	(cd "$tree" && CC=clang CFLAGS="-g -O1 -fsanitize=fuzzer-no-link" \
		"$src/configure" --enable-sanitizers >configure.log 2>&1) || {
		cat "$tree/configure.log" >&2
		exit 1
	}
fi
# the generated headers first: a target named alone does not make them
{ make -C "$tree" built-sources &&
	make -C "$tree" -j"$(nproc 2>/dev/null || echo 2)" libepjit_core.la; } >"$tree/make.log" 2>&1 || {
	tail -30 "$tree/make.log" >&2
	exit 1
}
flags="-std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer -fopenmp
	-I$src/lib -I$src/jit -I$src/kernels -I$src/runtime -I$src/t/fuzz -I$tree
	$(pkg-config --cflags jansson)"
clang $flags -fsanitize=fuzzer-no-link,address,undefined \
	-c "$src/t/fuzz/fuzz_util.c" -o "$out/fuzz_util.o"
for t in safetensors checkpoint ckpt_set ds_config hf_config tokens kcache archive; do
	clang $flags -fsanitize=fuzzer-no-link,address,undefined \
		-c "$src/t/fuzz/fuzz_$t.c" -o "$out/fuzz_$t.o"
	"$tree/libtool" --mode=link --tag=CC clang -fopenmp \
		-fsanitize=fuzzer,address,undefined -o "$out/fuzz_$t" \
		"$out/fuzz_util.o" "$out/fuzz_$t.o" "$tree/libepjit_core.la" \
		$(pkg-config --libs jansson) >/dev/null
	echo "built $out/fuzz_$t"
done
