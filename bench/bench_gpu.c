/* bench/bench_gpu.c -- the GPU benchmark of what runs on a GPU today: the
 * fused kernels of a Qwen3-30B-A3B-shaped decoder block, each timed on the
 * device against a device-to-device copy measured in the same run.
 *
 * The model is qwen3-30b-a3b.config.json (--model; default the copy in
 * bench/configs, relative to the source root: hidden 2048, 32
 * query and 4 key/value heads of 128, RMSNorm, RoPE) with --layers blocks
 * (default 1: every block compiles to the same graphs) and --experts
 * experts (default 8) and a --vocab of 4096 (the experts run eagerly and
 * the embedding and head are outside the regions: neither changes the
 * compiled kernels; both would only make setup slow), random weights, bf16 with
 * FP32 masters, activation checkpointing, sequence --seq (1024), micro-batch
 * --batch (1).  One training step on a cuda context (everything on the
 * GPU: the CPU's GEMMs at these shapes would take minutes) with
 * compile.backend "nvrtc" traces and compiles every region variant; then
 * every fused kernel of every compiled graph runs
 * --iters times on fresh random inputs between two events.  Reported per
 * kernel: bytes moved (inputs read + outputs written), time, GB/s and the
 * ratio to the copy bandwidth; then the median and the worst ratio over
 * kernels moving at least 8 MiB (the target: >= 0.85).
 *
 * Not measured here: eager against compiled training steps on the GPU,
 * which bench-compile --device cuda measures (tools/gpu-check runs both).
 *
 * Usage: bench-gpu [--model FILE] [--seq T] [--batch B] [--layers N]
 *                  [--experts E] [--iters N] [--vocab V] [--json FILE]
 * Exit status: 0 when it ran, 1 on any failure, 2 when there is no GPU.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_driver.h"
#include "jit_impl.h"
#include "kir.h"
#include "runtime_impl.h"

#define PROG "bench-gpu"

typedef struct row {
	char graph[48];
	int kernel;
	bool reduce;
	double mb, us, gbps, ratio;
} row;

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static int fail(epj_ctx *ctx, const char *what)
{
	fprintf(stderr, PROG ": %s: %s\n", what, ctx ? epj_ctx_error(ctx) : "");
	return 1;
}

/* The model config with layers and experts replaced, in a temp file. */
static char *write_model(const char *path, long layers, long experts,
			 long vocab)
{
	json_error_t err;
	json_t *j = json_load_file(path, 0, &err);
	if (!j) {
		fprintf(stderr, PROG ": %s: %s\n", path, err.text);
		return NULL;
	}
	json_object_set_new(j, "num_hidden_layers", json_integer(layers));
	json_object_set_new(j, "num_experts", json_integer(experts));
	json_object_set_new(j, "vocab_size", json_integer(vocab));
	static char tmp[] = "/tmp/epjit-bench-gpu-XXXXXX";
	int fd = mkstemp(tmp);
	char *text = json_dumps(j, JSON_INDENT(1));
	json_decref(j);
	if (fd < 0 || !text || write(fd, text, strlen(text)) < 0) {
		free(text);
		return NULL;
	}
	close(fd);
	free(text);
	return tmp;
}

/* Fresh positive inputs (log/rsqrt stay finite) for kernel k. */
static epj_tensor *fresh(epj_ctx *ctx, const ej_value *v, uint64_t *seed)
{
	epj_tensor *t = epj_zeros(ctx, v->dtype, v->ndim, v->shape);
	if (!t)
		return NULL;
	int64_t n = epj_tensor_numel(t);
	for (int64_t i = 0; i < n; i++) {
		*seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
		double u = (double)(*seed >> 11) / 9007199254740992.0;
		epj_tensor_set_f64(t, i, 0.25 + u);
	}
	return t;
}

int main(int argc, char **argv)
{
	const char *model = "bench/configs/qwen3-30b-a3b.config.json";
	const char *json_out = NULL;
	long seq = 1024, batch = 1, layers = 1, experts = 8, iters = 50;
	long vocab = 4096;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--model") && v)
			model = argv[++i];
		else if (!strcmp(a, "--json") && v)
			json_out = argv[++i];
		else if (!strcmp(a, "--seq") && v)
			seq = atol(argv[++i]);
		else if (!strcmp(a, "--batch") && v)
			batch = atol(argv[++i]);
		else if (!strcmp(a, "--layers") && v)
			layers = atol(argv[++i]);
		else if (!strcmp(a, "--experts") && v)
			experts = atol(argv[++i]);
		else if (!strcmp(a, "--iters") && v)
			iters = atol(argv[++i]);
		else if (!strcmp(a, "--vocab") && v)
			vocab = atol(argv[++i]);
		else {
			fprintf(stderr,
				"usage: " PROG " [--model FILE] [--seq T] "
				"[--batch B] [--layers N] [--experts E] "
				"[--iters N] [--vocab V] [--json FILE]\n");
			return 1;
		}
	}
	if (seq < 1 || batch < 1 || layers < 1 || experts < 1 || iters < 1 ||
	    vocab < 2) {
		fprintf(stderr, PROG ": sizes and counts must be >= 1\n");
		return 1;
	}
	/* ctx: the timing (host inputs copied into the kernel's device
	 * buffers); g: the model and its training step, on the GPU */
	epj_ctx *ctx = NULL, *g = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 1;
	ej_cuda_dev *dev = NULL;
	if (ej_cuda_open(ctx, &dev) != EPJ_OK ||
	    epj_ctx_new("cuda", &g) != EPJ_OK) {
		fprintf(stderr, PROG ": no GPU: %s\n", epj_ctx_error(ctx));
		epj_ctx_free(ctx);
		epj_ctx_free(g);
		return 2;
	}
	ej_cuda_dev_info info;
	ej_cuda_info(dev, &info);
	char *mpath = write_model(model, layers, experts, vocab);
	if (!mpath)
		return fail(NULL, "cannot write the model config");
	epj_model_opts mo = { .layout = EPJ_LAYOUT_NESTED,
			      .seed = 7,
			      .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	epj_status st = epj_model_new(g, mpath, &mo, &m);
	unlink(mpath);
	if (st != EPJ_OK)
		return fail(g, "model");
	char cfg[512];
	snprintf(cfg, sizeof cfg,
		 "{\"train_micro_batch_size_per_gpu\": %ld,"
		 " \"bf16\": {\"enabled\": true},"
		 " \"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": "
		 "1e-4}},"
		 " \"activation_checkpointing\": {\"enabled\": true},"
		 " \"compile\": {\"autoep_non_moe\": true, \"backend\": "
		 "\"nvrtc\"}}",
		 batch);
	epj_engine *e = NULL;
	if (epj_engine_initialize_json(g, m, cfg, "<bench-gpu>", &e) !=
		EPJ_OK ||
	    epj_engine_compile(e) != EPJ_OK)
		return fail(g, "engine");
	epj_corpus *c =
	    epj_corpus_synthetic(g, (uint32_t)epj_model_vocab_size(m), 11);
	epj_tensor *ids = NULL, *labels = NULL;
	if (!c ||
	    epj_corpus_next_batch(g, c, batch, seq, &ids, &labels) != EPJ_OK)
		return fail(g, "batch");
	/* one step: traces and compiles every variant (checkpointing: the
	 * no-grad forward and the replay) */
	if (epj_engine_train_step(e, ids, labels, NULL) != EPJ_OK)
		return fail(g, "training step");
	double copy_gbps = 0;
	if (ej_backend_cuda_copy_bandwidth(ctx, (size_t)256 << 20, 20,
					   &copy_gbps) != EPJ_OK)
		return fail(ctx, "copy bandwidth");
	printf("# %s (%s, %d SMs), driver %d.%d, seq %ld x batch %ld, "
	       "bf16, checkpointing on\n",
	       info.name, info.arch, info.sm_count, info.driver_version / 1000,
	       info.driver_version % 1000 / 10, seq, batch);
	printf("# device-to-device copy: %.1f GB/s (read + write)\n",
	       copy_gbps);
	printf("%-20s %6s %-9s %10s %10s %10s %8s\n", "graph", "kernel", "kind",
	       "MB moved", "us", "GB/s", "of copy");
	ej_jit *jit = ej_engine_jit(e);
	row *rows = NULL;
	int n_rows = 0, cap = 0;
	uint64_t seed = 1;
	for (int si = 0; jit && si < jit->cache_cap; si++) {
		ej_segment *seg = jit->cache[si];
		if (!seg || seg->backend != &ej_backend_cuda)
			continue;
		void *states[2] = { seg->fwd_state, seg->bwd_state };
		for (int w = 0; w < 2; w++) {
			if (!states[w])
				continue;
			const ej_schedule *s =
			    ej_backend_cuda_schedule(states[w]);
			for (int ki = 0; ki < s->n_kernels; ki++) {
				const ej_kernel *k = s->kernels[ki];
				epj_tensor *in[64] = { 0 };
				for (int i = 0; i < k->n_in && i < 64; i++)
					in[i] = fresh(
					    ctx, &s->g->values[k->in[i].value],
					    &seed);
				double us = 0, bytes = 0;
				st = ej_backend_cuda_time_kernel(
				    ctx, states[w], ki, in, (int)iters, &us,
				    &bytes);
				for (int i = 0; i < k->n_in && i < 64; i++)
					epj_tensor_free(in[i]);
				if (st != EPJ_OK)
					return fail(ctx, "timing a kernel");
				if (n_rows == cap) {
					cap = cap ? 2 * cap : 64;
					rows = realloc(rows, sizeof *rows *
								 (size_t)cap);
				}
				row *r = &rows[n_rows++];
				snprintf(r->graph, sizeof r->graph, "%s%s",
					 seg->sig_hex, w ? "/bwd" : "/fwd");
				r->graph[20] = 0;
				r->kernel = ki;
				r->reduce = k->reduce;
				r->mb = bytes / (1 << 20);
				r->us = us;
				r->gbps = us > 0 ? bytes / (us * 1e3) : 0;
				r->ratio =
				    copy_gbps > 0 ? r->gbps / copy_gbps : 0;
				printf("%-20s %6d %-9s %10.2f %10.2f %10.1f "
				       "%7.0f%%\n",
				       r->graph, ki,
				       r->reduce ? "row-red" : "pointwise",
				       r->mb, r->us, r->gbps, 100 * r->ratio);
			}
		}
	}
	double *big = calloc((size_t)n_rows + 1, sizeof *big);
	int n_big = 0;
	for (int i = 0; i < n_rows; i++)
		if (rows[i].mb >= 8)
			big[n_big++] = rows[i].ratio;
	qsort(big, (size_t)n_big, sizeof *big, cmp_d);
	double med = n_big ? big[n_big / 2] : NAN;
	double worst = n_big ? big[0] : NAN;
	printf("# %d fused kernels, %d moving >= 8 MiB: median %.0f%%, worst "
	       "%.0f%% of the copy bandwidth (target >= 85%%)\n",
	       n_rows, n_big, 100 * med, 100 * worst);
	printf("# eager vs compiled steps on the GPU: bench-compile --device "
	       "cuda\n");
	if (json_out) {
		FILE *f = fopen(json_out, "w");
		if (f) {
			/* JSON has no NaN: null when no kernel moved 8 MiB */
			char ms[32] = "null", ws[32] = "null";
			if (n_big) {
				snprintf(ms, sizeof ms, "%.4f", med);
				snprintf(ws, sizeof ws, "%.4f", worst);
			}
			fprintf(f,
				"{\"device\": \"%s\", \"arch\": \"%s\", "
				"\"copy_gbps\": %.3f, \"kernels\": %d, "
				"\"kernels_8mib\": %d, \"median_ratio\": %s, "
				"\"worst_ratio\": %s}\n",
				info.name, info.arch, copy_gbps, n_rows, n_big,
				ms, ws);
			fclose(f);
		}
	}
	free(big);
	free(rows);
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	epj_corpus_free(c);
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(g);
	epj_ctx_free(ctx);
	return 0;
}
