/* check_save.c -- suite "save": background saves (runtime/ckpt_async.c)
 * on one rank; t/save.sh runs them through epjit-train, on 2 ranks too.
 *
 *  - test_snapshot: a background save is the state of the step it was
 *    started at, whatever training does meanwhile: its writer is held at
 *    its start (ej_save_phase_hook) while the engine trains two more steps,
 *    and the file it then writes is byte for byte the foreground save of
 *    an engine stopped at that step (AdamW f32; SGD with momentum in bf16
 *    with gradient accumulation).  The pending state goes WRITING ->
 *    WRITTEN -> NONE, and a second finish has nothing to do.
 *  - test_kill_phase (one case per phase of the writer: start, write,
 *    filled, written): a child process saves step 2 in the foreground,
 *    then step 4 in the background with EPJIT_TEST_SAVE_HOLD at the phase,
 *    and is killed with SIGKILL once it says it holds there.  The file then
 *    loads at step 2 (phases before the rename) or 4 (after it), and the
 *    resumed engine's next losses are bit for bit an uninterrupted run's.
 *  - test_writer_errors: a writer that cannot create its file (its folder
 *    removed while it is held) and a state with a NaN fail the save at
 *    finish with a message naming the file or the entry, leave the file
 *    there as it was, and let training and the next save go on.
 *  - test_pinned: on the stand-in cuda driver the snapshot goes to page-
 *    locked memory (save.snapshot.pinned_bytes) and the file equals the
 *    foreground save's.
 */
#include "check_util.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "optim_impl.h"
#include "runtime_impl.h"

#define S_V 16 /* TU_TINY_MOE_JSON's vocabulary */

#define ADAMW_F32                                                              \
	"{\"train_micro_batch_size_per_gpu\": 2, \"optimizer\": {\"type\": "   \
	"\"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.05}}, "     \
	"\"gradient_clipping\": 0.5}"
#define SGD_BF16_GAS2                                                          \
	"{\"train_micro_batch_size_per_gpu\": 2, "                             \
	"\"gradient_accumulation_steps\": 2, \"bf16\": {\"enabled\": true}, "  \
	"\"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 0.05, "       \
	"\"momentum\": 0.9}}}"

/* The tiny model of config dir/config.json (written by model_config). */
static epj_model *new_model(epj_ctx *ctx, const char *dir, uint64_t seed)
{
	char cfg[4200];
	snprintf(cfg, sizeof cfg, "%s/config.json", dir);
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = seed,
			     .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	epj_status st = epj_model_new(ctx, cfg, &o, &m);
	ck_assert_msg(st == EPJ_OK, "model: %s", epj_ctx_error(ctx));
	return m;
}

/* A test folder with the model's config.json in it. */
static char *model_dir(void)
{
	char *dir = tu_tmpdir_new("save");
	char *cfg = tu_path(dir, "config.json");
	tu_write_text(cfg, TU_TINY_MOE_JSON);
	free(cfg);
	return dir;
}

static epj_engine *new_engine(epj_ctx *ctx, epj_model *m, const char *json)
{
	epj_engine *e = NULL;
	ck_assert_msg(
	    epj_engine_initialize_json(ctx, m, json, "save.json", &e) == EPJ_OK,
	    "engine: %s", epj_ctx_error(ctx));
	return e;
}

/* The i-th micro-batch of the stream of seed (drawn again each call). */
static void batch(epj_ctx *ctx, uint64_t seed, int i, epj_tensor **ids,
		  epj_tensor **lab)
{
	epj_corpus *c = epj_corpus_synthetic(ctx, S_V, seed);
	tu_ok(ctx, c);
	ck_assert_int_eq(epj_corpus_skip(ctx, c, i, 2, 7), EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 2, 7, ids, lab), EPJ_OK);
	epj_corpus_free(c);
}

/* Micro-batches [from, to) of the stream into e; the last loss. */
static double train(epj_ctx *ctx, epj_engine *e, uint64_t seed, int from,
		    int to)
{
	double loss = NAN;
	for (int i = from; i < to; i++) {
		epj_tensor *ids, *lab;
		batch(ctx, seed, i, &ids, &lab);
		epj_step_info info;
		ck_assert_msg(epj_engine_train_step(e, ids, lab, &info) ==
				  EPJ_OK,
			      "train step: %s", epj_ctx_error(ctx));
		loss = info.loss;
		epj_tensor_free(ids);
		epj_tensor_free(lab);
	}
	return loss;
}

static void assert_same_file(const char *a, const char *b)
{
	size_t na, nb;
	unsigned char *x = tu_read_file(a, &na), *y = tu_read_file(b, &nb);
	ck_assert_msg(na == nb && !memcmp(x, y, na),
		      "%s (%zu bytes) and %s (%zu bytes) differ", a, na, b, nb);
	free(x);
	free(y);
}

/* ---- a gate the writer waits at (ej_save_phase_hook) ---- */

static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_closed, gate_reached;

static void gate_hook(const char *phase, int rank, int64_t step)
{
	(void)rank, (void)step;
	if (strcmp(phase, "start") != 0)
		return;
	pthread_mutex_lock(&gate_mu);
	gate_reached = true;
	pthread_cond_broadcast(&gate_cv);
	while (gate_closed)
		pthread_cond_wait(&gate_cv, &gate_mu);
	pthread_mutex_unlock(&gate_mu);
}

static void gate_close(void)
{
	pthread_mutex_lock(&gate_mu);
	gate_closed = true;
	gate_reached = false;
	pthread_mutex_unlock(&gate_mu);
	ej_save_phase_hook = gate_hook;
}

/* Waits until the writer is at the gate. */
static void gate_wait_reached(void)
{
	pthread_mutex_lock(&gate_mu);
	while (!gate_reached)
		pthread_cond_wait(&gate_cv, &gate_mu);
	pthread_mutex_unlock(&gate_mu);
}

static void gate_open(void)
{
	pthread_mutex_lock(&gate_mu);
	gate_closed = false;
	pthread_cond_broadcast(&gate_cv);
	pthread_mutex_unlock(&gate_mu);
}

static void gate_remove(void)
{
	gate_open();
	ej_save_phase_hook = NULL;
}

/* ---- the snapshot is the step's state ---- */

static void snapshot_case(const char *json)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = model_dir();
	char *bg = tu_path(dir, "bg.ckpt"), *fg = tu_path(dir, "fg.ckpt");
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *m1 = new_model(ctx, dir, seed),
		  *m2 = new_model(ctx, dir, seed);
	epj_engine *e1 = new_engine(ctx, m1, json),
		   *e2 = new_engine(ctx, m2, json);
	int gas = (int)epj_engine_grad_accum_steps(e1);
	train(ctx, e1, seed, 0, 3 * gas);
	train(ctx, e2, seed, 0, 3 * gas);
	ck_assert_int_eq(epj_engine_save_pending(e1), EPJ_SAVE_NONE);

	gate_close();
	ck_assert_msg(epj_engine_save_async(e1, bg) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	gate_wait_reached();
	ck_assert_int_eq(epj_engine_save_pending(e1), EPJ_SAVE_WRITING);
	/* training moves every master and optimizer state meanwhile */
	train(ctx, e1, seed, 3 * gas, 5 * gas);
	ck_assert(!tu_exists(bg));
	gate_open();
	int64_t step = -2;
	ck_assert_msg(epj_engine_save_finish(e1, &step) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	gate_remove();
	ck_assert_int_eq(step, 3);
	ck_assert_int_eq(epj_engine_save_pending(e1), EPJ_SAVE_NONE);
	ck_assert_int_eq(epj_engine_save_finish(e1, &step), EPJ_OK);
	ck_assert_int_eq(step, -1);
	ck_assert_int_eq(epj_counter_get(ctx, "save.background"), 1);
	ck_assert_int_gt(epj_counter_get(ctx, "save.snapshot.bytes"), 0);
	ck_assert_int_eq(epj_counter_get(ctx, "save.snapshot.pinned_bytes"), 0);

	ck_assert_int_eq(epj_engine_save(e2, fg), EPJ_OK);
	assert_same_file(bg, fg);
	/* the next background save reuses the host buffer and sees step 5 */
	ck_assert_int_eq(epj_engine_save_async(e1, bg), EPJ_OK);
	ck_assert_int_eq(epj_engine_save_finish(e1, &step), EPJ_OK);
	ck_assert_int_eq(step, 5);
	train(ctx, e2, seed, 3 * gas, 5 * gas);
	ck_assert_int_eq(epj_engine_save(e2, fg), EPJ_OK);
	assert_same_file(bg, fg);

	epj_engine_free(e1);
	epj_engine_free(e2);
	epj_model_free(m1);
	epj_model_free(m2);
	free(bg);
	free(fg);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}

START_TEST(test_snapshot)
{
	snapshot_case(_i == 0 ? ADAMW_F32 : SGD_BF16_GAS2);
}
END_TEST

/* ---- SIGKILL at each phase of the writer ---- */

static const char *const phases[] = { "start", "write", "filled", "written" };

/* The child: step 2 saved in the foreground, step 4 in the background
 * with the writer held at `phase`; never returns (killed there). */
static void kill_child(const char *dir, const char *path, uint64_t seed,
		       const char *phase, int err_fd)
{
	char v[64];
	snprintf(v, sizeof v, "%s::4", phase);
	setenv("EPJIT_TEST_SAVE_HOLD", v, 1);
	dup2(err_fd, 2);
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		_exit(3);
	epj_model *m = new_model(ctx, dir, seed);
	epj_engine *e = new_engine(ctx, m, ADAMW_F32);
	train(ctx, e, seed, 0, 2);
	if (epj_engine_save(e, path) != EPJ_OK)
		_exit(4);
	train(ctx, e, seed, 2, 4);
	if (epj_engine_save_async(e, path) != EPJ_OK)
		_exit(5);
	train(ctx, e, seed, 4, 6);
	int64_t step;
	epj_engine_save_finish(e, &step); /* waits for the held writer */
	_exit(6);
}

/* Reads the child's stderr until it says it holds the save; false at EOF
 * (the child died first: its output is in buf). */
static bool read_hold(int fd, char *buf, size_t n)
{
	size_t len = 0;
	buf[0] = '\0';
	while (!strstr(buf, "holds the save") && len + 1 < n) {
		ssize_t k = read(fd, buf + len, n - 1 - len);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return false;
		len += (size_t)k;
		buf[len] = '\0';
	}
	return strstr(buf, "holds the save") != NULL;
}

START_TEST(test_kill_phase)
{
	const char *phase = phases[_i];
	char *dir = model_dir();
	char *path = tu_path(dir, "k.ckpt");
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	pid_t pid = fork(); /* before this process computes anything */
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(p[0]);
		kill_child(dir, path, seed, phase, p[1]);
	}
	close(p[1]);
	char out[4096];
	bool held = read_hold(p[0], out, sizeof out);
	ck_assert_int_eq(kill(pid, SIGKILL), 0);
	int ws;
	ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
	close(p[0]);
	ck_assert_msg(held, "the child did not hold at '%s': %s", phase, out);
	ck_assert(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
	ck_assert_msg(strstr(out, phase), "%s", out);

	/* the file is the last committed save, whole; the resumed engine
	 * takes the uninterrupted run's next steps */
	int64_t want = !strcmp(phase, "written") ? 4 : 2;
	epj_ctx *ctx = tu_ctx();
	epj_model *mr = new_model(ctx, dir, seed + 1),
		  *mu = new_model(ctx, dir, seed);
	epj_engine *er = new_engine(ctx, mr, ADAMW_F32),
		   *eu = new_engine(ctx, mu, ADAMW_F32);
	ck_assert_msg(epj_engine_load(er, path) == EPJ_OK, "%s: %s", phase,
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_step_count(er), want);
	train(ctx, eu, seed, 0, (int)want);
	for (int i = (int)want; i < 6; i++) {
		double a = train(ctx, er, seed, i, i + 1);
		double b = train(ctx, eu, seed, i, i + 1);
		ck_assert_msg(a == b,
			      "killed at '%s': step %d loss %.9g resumed, "
			      "%.9g uninterrupted",
			      phase, i + 1, a, b);
	}
	epj_engine_free(er);
	epj_engine_free(eu);
	epj_model_free(mr);
	epj_model_free(mu);
	epj_ctx_free(ctx);
	free(path);
	tu_tmpdir_free(dir);
}
END_TEST

/* ---- a writer that fails ---- */

START_TEST(test_writer_errors)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = model_dir();
	char *sub = tu_path(dir, "gone"), *path = tu_path(sub, "w.ckpt");
	char *keep = tu_path(dir, "keep.ckpt");
	ck_assert_int_eq(mkdir(sub, 0700), 0);
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *m = new_model(ctx, dir, seed);
	epj_engine *e = new_engine(ctx, m, ADAMW_F32);
	train(ctx, e, seed, 0, 2);

	/* the folder goes while the writer waits at its start */
	gate_close();
	ck_assert_int_eq(epj_engine_save_async(e, path), EPJ_OK);
	gate_wait_reached();
	ck_assert_int_eq(rmdir(sub), 0);
	train(ctx, e, seed, 2, 3);
	gate_open();
	int64_t step = 0;
	ck_assert_int_ne(epj_engine_save_finish(e, &step), EPJ_OK);
	gate_remove();
	ck_assert_int_eq(step, -1);
	ck_assert_msg(strstr(epj_ctx_error(ctx), path), "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_engine_save_pending(e), EPJ_SAVE_NONE);
	epj_ctx_clear_error(ctx);

	/* a NaN: refused by the writer, the file there stays */
	train(ctx, e, seed, 3, 4);
	ck_assert_int_eq(epj_engine_save(e, keep), EPJ_OK);
	size_t n0;
	unsigned char *before = tu_read_file(keep, &n0);
	epj_tensor *master = ej_optim_master(e->optim, 0);
	epj_tensor *t = master ? master : epj_model_param(m, 0);
	double was = epj_tensor_get_f64(t, 1);
	epj_tensor_set_f64(t, 1, NAN);
	ck_assert_int_eq(epj_engine_save_async(e, keep), EPJ_OK);
	ck_assert_int_eq(epj_engine_save_finish(e, &step), EPJ_ERR_STATE);
	ck_assert_msg(
	    strstr(epj_ctx_error(ctx), "element 1 is nan") &&
		strstr(epj_ctx_error(ctx), epj_model_param_name(m, 0)),
	    "%s", epj_ctx_error(ctx));
	size_t n1;
	unsigned char *after = tu_read_file(keep, &n1);
	ck_assert(n0 == n1 && !memcmp(before, after, n0));
	free(before);
	free(after);
	epj_ctx_clear_error(ctx);

	/* the engine goes on: a finite state saves again */
	epj_tensor_set_f64(t, 1, was);
	ck_assert_int_eq(epj_engine_save_async(e, keep), EPJ_OK);
	ck_assert_msg(epj_engine_save_finish(e, &step) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(step, 4);

	epj_engine_free(e);
	epj_model_free(m);
	free(sub);
	free(path);
	free(keep);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- page-locked memory on the cuda device ---- */

START_TEST(test_pinned)
{
	if (!tu_fake_cuda_usable())
		return; /* no stand-in driver in this build */
	ck_assert(tu_fake_cuda_begin());
	epj_ctx *g = NULL;
	ck_assert_msg(epj_ctx_new("cuda", &g) == EPJ_OK && g,
		      "epj_ctx_new(\"cuda\") on the stand-in driver failed");
	epj_ctx_seed(g, tu_seed());
	char *dir = model_dir();
	char *bg = tu_path(dir, "bg.ckpt"), *fg = tu_path(dir, "fg.ckpt");
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *m = new_model(g, dir, seed);
	epj_engine *e = new_engine(g, m, ADAMW_F32);
	train(g, e, seed, 0, 2);
	ck_assert_msg(epj_engine_save_async(e, bg) == EPJ_OK, "%s",
		      epj_ctx_error(g));
	int64_t step;
	ck_assert_msg(epj_engine_save_finish(e, &step) == EPJ_OK, "%s",
		      epj_ctx_error(g));
	ck_assert_int_eq(step, 2);
	int64_t b = epj_counter_get(g, "save.snapshot.bytes");
	ck_assert_int_gt(b, 0);
	ck_assert_int_eq(epj_counter_get(g, "save.snapshot.pinned_bytes"), b);
	ck_assert_msg(epj_engine_save(e, fg) == EPJ_OK, "%s", epj_ctx_error(g));
	assert_same_file(bg, fg);
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(g);
	free(bg);
	free(fg);
	tu_tmpdir_free(dir);
	tu_fake_cuda_end();
}
END_TEST

Suite *make_save_suite(void)
{
	Suite *s = suite_create("save");
	TCase *tc = tcase_create("background");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, test_snapshot, 0, 2);
	tcase_add_loop_test(tc, test_kill_phase, 0,
			    (int)(sizeof phases / sizeof *phases));
	tcase_add_test(tc, test_writer_errors);
	tcase_add_test(tc, test_pinned);
	suite_add_tcase(s, tc);
	return s;
}
