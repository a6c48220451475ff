/* ckpt_set.c -- the commit record of a multi-rank checkpoint.
 *
 * With several ranks a save to PATH is one generation G: every rank writes
 * its state to "PATH.g<G>.rank<R>" (atomically, temp file + rename), then
 * rank 0 writes PATH itself, atomically: a small JSON record naming the
 * generation, the world, the step counters and, for every rank, its file's
 * name, size and XXH3-128 checksum.  That rename is the commit: until it
 * happens PATH still names the previous generation, whose files are only
 * removed after the new record is in place.  A load verifies every rank's
 * file against the record (size, checksum, generation and counters in its
 * metadata) and compares the counters across ranks before anything is
 * copied, so a mixed or incomplete set is refused by name.
 *
 *   {
 *     "format": "epjit-checkpoint-set-1",
 *     "generation": 2, "world_size": 2,
 *     "zero_stage": 2, "autoep_size": 2,
 *     "step": 6, "micro_step": 6, "optimizer_steps": 6,
 *     "files": [
 *       {"rank": 0, "name": "run.ckpt.g2.rank0", "bytes": 91234,
 *        "xxh3_128": "<32 hex digits>"}, ...
 *     ]
 *   }
 *
 * File names are plain names in PATH's directory (no '/', never "." or
 * ".."), so a record cannot point a load anywhere else.
 *
 * A writer never commits what a reader refuses: ej_ckpt_set_write parses
 * its own text, with the reader's size limit (EJ_CKPT_SET_MAX_BYTES), before
 * the rename.  After a commit only the files the previous record names are
 * removed (ej_ckpt_set_prune), never files found by their names' pattern.
 *
 * A save that keeps K > 1 generations (epj_engine_set_save_keep) also
 * writes each generation's record as "PATH.g<G>.record"
 * (ej_ckpt_set_copy_path), which loads like PATH; the commit of G then
 * drops generation G - K: the files that record names, and the record.
 */
#include "runtime_impl.h"

#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

void ej_ckpt_set_free(ej_ckpt_set *s)
{
	if (!s)
		return;
	free(s->files);
	memset(s, 0, sizeof *s);
}

bool ej_ckpt_set_sniff(const char *buf, size_t n)
{
	static const char tag[] = "\"" EJ_CKPT_SET_FORMAT_PREFIX;
	if (n == 0 || buf[0] != '{')
		return false;
	size_t lim = n < 256 ? n : 256;
	for (size_t i = 0; i + sizeof tag - 1 <= lim; i++)
		if (!memcmp(buf + i, tag, sizeof tag - 1))
			return true;
	return false;
}

/* Integer member k of o in [lo, hi]; else an error naming it. */
static epj_status get_int(epj_ctx *ctx, const char *path, json_t *o,
			  const char *k, int64_t lo, int64_t hi, int64_t *out)
{
	json_t *v = json_object_get(o, k);
	if (!json_is_integer(v) || json_integer_value(v) < lo ||
	    json_integer_value(v) > hi)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s': \"%s\" must be a whole "
				"number in [%" PRId64 ", %" PRId64 "]",
				path, k, lo, hi);
	*out = json_integer_value(v);
	return EPJ_OK;
}

static bool plain_name(const char *s)
{
	size_t n = strlen(s);
	return n > 0 && n < EJ_CKPT_NAME_MAX && !strchr(s, '/') &&
	       strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static bool hex32(const char *s)
{
	if (strlen(s) != 32)
		return false;
	for (int i = 0; i < 32; i++)
		if (!((s[i] >= '0' && s[i] <= '9') ||
		      (s[i] >= 'a' && s[i] <= 'f')))
			return false;
	return true;
}

static epj_status parse_files(epj_ctx *ctx, const char *path, json_t *arr,
			      ej_ckpt_set *s)
{
	if (!json_is_array(arr) || (int64_t)json_array_size(arr) != s->world)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s': \"files\" must list one "
				"file per rank (%" PRId64 ")",
				path, s->world);
	s->files = calloc((size_t)s->world, sizeof *s->files);
	if (!s->files)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"checkpoint set '%s': out of memory", path);
	for (int64_t r = 0; r < s->world; r++) {
		json_t *f = json_array_get(arr, (size_t)r);
		int64_t rank = -1, bytes = -1;
		epj_status st =
		    json_is_object(f)
			? EPJ_OK
			: ej_error(ctx, EPJ_ERR_FORMAT,
				   "checkpoint set '%s': files[%" PRId64
				   "] is not an object",
				   path, r);
		if (st == EPJ_OK)
			st = get_int(ctx, path, f, "rank", r, r, &rank);
		if (st == EPJ_OK)
			st = get_int(ctx, path, f, "bytes", 8, INT64_MAX,
				     &bytes);
		const char *nm = json_string_value(json_object_get(f, "name"));
		const char *h =
		    json_string_value(json_object_get(f, "xxh3_128"));
		if (st == EPJ_OK && (!nm || !plain_name(nm)))
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "checkpoint set '%s': the file of rank "
				      "%" PRId64 " must be a plain file name "
				      "in the record's directory",
				      path, r);
		if (st == EPJ_OK && (!h || !hex32(h)))
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "checkpoint set '%s': the checksum of "
				      "rank %" PRId64 "'s file must be 32 "
				      "lowercase hex digits",
				      path, r);
		if (st != EPJ_OK)
			return st;
		s->files[r].bytes = bytes;
		snprintf(s->files[r].name, sizeof s->files[r].name, "%s", nm);
		memcpy(s->files[r].hash, h, 33);
	}
	return EPJ_OK;
}

/* "format" is EJ_CKPT_SET_FORMAT; a record of another version says so. */
static epj_status check_format(epj_ctx *ctx, const char *path, json_t *o)
{
	const char *fmt = json_string_value(json_object_get(o, "format"));
	if (json_is_object(o) && fmt && !strcmp(fmt, EJ_CKPT_SET_FORMAT))
		return EPJ_OK;
	size_t pl = strlen(EJ_CKPT_SET_FORMAT_PREFIX);
	const char *v = fmt && !strncmp(fmt, EJ_CKPT_SET_FORMAT_PREFIX, pl)
			    ? fmt + pl
			    : NULL;
	if (v && *v && strspn(v, "0123456789") == strlen(v) && strlen(v) < 20)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s': commit record format "
				"version %s, this build reads %d",
				path, v, EJ_CKPT_SET_VERSION);
	return ej_error(ctx, EPJ_ERR_FORMAT,
			"checkpoint set '%s': \"format\" is not \"%s\"", path,
			EJ_CKPT_SET_FORMAT);
}

epj_status ej_ckpt_set_parse(epj_ctx *ctx, const char *path, const char *text,
			     size_t len, ej_ckpt_set *s)
{
	memset(s, 0, sizeof *s);
	json_error_t jerr;
	json_t *o = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!o)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s': invalid JSON at line "
				"%d, column %d: %s",
				path, jerr.line, jerr.column, jerr.text);
	epj_status st = check_format(ctx, path, o);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "generation", 1, EJ_CKPT_GEN_MAX,
			     &s->generation);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "world_size", 2,
			     EJ_CKPT_SET_MAX_WORLD, &s->world);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "zero_stage", 0, 3, &s->zero_stage);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "autoep_size", 1,
			     EJ_CKPT_SET_MAX_WORLD, &s->autoep_size);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "step", 0, INT32_MAX, &s->step);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "micro_step", 0, INT32_MAX,
			     &s->micro_step);
	if (st == EPJ_OK)
		st = get_int(ctx, path, o, "optimizer_steps", 0, s->step,
			     &s->optimizer_steps);
	if (st == EPJ_OK)
		st = parse_files(ctx, path, json_object_get(o, "files"), s);
	json_decref(o);
	if (st != EPJ_OK)
		ej_ckpt_set_free(s);
	return st;
}

/* ---- writing the record ---------------------------------------------- */

static epj_status put_text(epj_ctx *ctx, FILE *fp, const char *tmp, void *u)
{
	const char *text = u;
	if (fputs(text, fp) == EOF)
		return ej_error(ctx, EPJ_ERR_IO, "checkpoint set: write '%s'",
				tmp);
	return EPJ_OK;
}

/* The record's text (JSON, a final newline; malloc'd), or NULL with the
 * error set. */
static char *record_text(epj_ctx *ctx, const char *path, const ej_ckpt_set *s)
{
	json_t *o = json_object(), *files = json_array();
	bool ok = o && files;
	ok = ok &&
	     !json_object_set_new(o, "format", json_string(EJ_CKPT_SET_FORMAT));
	ok = ok &&
	     !json_object_set_new(o, "generation", json_integer(s->generation));
	ok =
	    ok && !json_object_set_new(o, "world_size", json_integer(s->world));
	ok = ok &&
	     !json_object_set_new(o, "zero_stage", json_integer(s->zero_stage));
	ok = ok && !json_object_set_new(o, "autoep_size",
					json_integer(s->autoep_size));
	ok = ok && !json_object_set_new(o, "step", json_integer(s->step));
	ok = ok &&
	     !json_object_set_new(o, "micro_step", json_integer(s->micro_step));
	ok = ok && !json_object_set_new(o, "optimizer_steps",
					json_integer(s->optimizer_steps));
	int64_t bad = -1; /* a rank whose file name jansson refused */
	for (int64_t r = 0; ok && r < s->world; r++) {
		json_t *f = json_pack("{sI ss sI ss}", "rank", (json_int_t)r,
				      "name", s->files[r].name, "bytes",
				      (json_int_t)s->files[r].bytes, "xxh3_128",
				      s->files[r].hash);
		ok = f && !json_array_append_new(files, f);
		if (!f)
			bad = r;
	}
	ok = ok && !json_object_set(o, "files", files);
	char *text =
	    ok ? json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
	json_decref(files);
	json_decref(o);
	size_t n = text ? strlen(text) : 0;
	char *nl = text ? realloc(text, n + 2) : NULL;
	if (!nl) {
		free(text);
		if (bad >= 0)
			ej_error(ctx, EPJ_ERR_INVALID,
				 "checkpoint set '%s': rank %" PRId64 "'s file "
				 "name is not valid UTF-8; nothing committed",
				 path, bad);
		else
			ej_error(ctx, EPJ_ERR_NOMEM,
				 "checkpoint set '%s': out of memory", path);
		return NULL;
	}
	memcpy(nl + n, "\n", 2);
	return nl;
}

epj_status ej_ckpt_set_write(epj_ctx *ctx, const char *path,
			     const ej_ckpt_set *s)
{
	char *text = record_text(ctx, path, s);
	if (!text)
		return ctx->status;
	/* what a reader would refuse is never committed */
	size_t n = strlen(text);
	epj_status st = EPJ_OK;
	if (n > EJ_CKPT_SET_MAX_BYTES)
		st = ej_error(ctx, EPJ_ERR_INVALID,
			      "checkpoint set '%s': the record of %" PRId64
			      " ranks takes %zu bytes, over the %zu a reader "
			      "accepts (their file names are too long); "
			      "nothing committed",
			      path, s->world, n, (size_t)EJ_CKPT_SET_MAX_BYTES);
	ej_ckpt_set back;
	if (st == EPJ_OK) {
		st = ej_ckpt_set_parse(ctx, path, text, n, &back);
		if (st != EPJ_OK)
			ej_error_prefix(ctx, "not committed, a reader would "
					     "refuse the record");
		else
			ej_ckpt_set_free(&back);
	}
	if (st == EPJ_OK)
		st = ej_write_atomic(ctx, "checkpoint set", path, put_text,
				     text);
	free(text);
	return st;
}

/* ---- files ----------------------------------------------------------- */

int ej_ckpt_set_read(const char *path, char **text, size_t *len)
{
	*text = NULL;
	*len = 0;
	const char *why;
	FILE *fp = ej_fopen_regular(path, &why);
	if (!fp)
		return 0;
	char head[256];
	size_t n = fread(head, 1, sizeof head, fp);
	if (!ej_ckpt_set_sniff(head, n)) {
		fclose(fp);
		return 0;
	}
	/* the size the file has now; a file that grows meanwhile is read up
	 * to the limit and refused past it */
	struct stat sb;
	bool sized = fstat(fileno(fp), &sb) == 0 && sb.st_size > 0;
	if (sized && (uint64_t)sb.st_size > EJ_CKPT_SET_MAX_BYTES) {
		fclose(fp);
		return -2;
	}
	size_t cap = sized ? (size_t)sb.st_size : EJ_CKPT_SET_MAX_BYTES;
	if (cap < n)
		cap = n;
	char *buf = malloc(cap + 1);
	if (!buf) {
		fclose(fp);
		return -1;
	}
	memcpy(buf, head, n);
	size_t m = n;
	for (;;) {
		m += fread(buf + m, 1, cap + 1 - m, fp);
		if (m <= cap || cap == EJ_CKPT_SET_MAX_BYTES || ferror(fp))
			break;
		/* longer than fstat said: read on, up to the limit + 1 */
		size_t nc = cap * 2 < EJ_CKPT_SET_MAX_BYTES
				? cap * 2
				: EJ_CKPT_SET_MAX_BYTES;
		char *nb = realloc(buf, nc + 1);
		if (!nb) {
			free(buf);
			fclose(fp);
			return -1;
		}
		buf = nb;
		cap = nc;
	}
	bool err = ferror(fp);
	fclose(fp);
	if (err || m > EJ_CKPT_SET_MAX_BYTES) {
		free(buf);
		return err ? -1 : -2;
	}
	*text = buf;
	*len = m;
	return 1;
}

epj_status ej_ckpt_set_read_error(epj_ctx *ctx, const char *path, int rc)
{
	if (rc == -2)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s': starts like a commit "
				"record but is over the %zu bytes a record "
				"may take",
				path, (size_t)EJ_CKPT_SET_MAX_BYTES);
	return ej_error(ctx, EPJ_ERR_FORMAT,
			"checkpoint set '%s': starts like a commit record but "
			"cannot be read whole (a read error)",
			path);
}

epj_status ej_file_hash(epj_ctx *ctx, const char *path, int64_t *bytes,
			char hex[33])
{
	const char *why;
	FILE *fp = ej_fopen_regular(path, &why);
	if (!fp)
		return ej_error(ctx, EPJ_ERR_IO, "%s: cannot read: %s", path,
				why);
	XXH3_state_t *h = XXH3_createState();
	unsigned char *buf = malloc(1 << 20);
	if (!h || !buf) {
		XXH3_freeState(h);
		free(buf);
		fclose(fp);
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s: out of memory", path);
	}
	XXH3_128bits_reset(h);
	int64_t total = 0;
	size_t n;
	while ((n = fread(buf, 1, 1 << 20, fp)) > 0) {
		XXH3_128bits_update(h, buf, n);
		total += (int64_t)n;
	}
	bool err = ferror(fp);
	fclose(fp);
	free(buf);
	XXH128_hash_t d = XXH3_128bits_digest(h);
	XXH3_freeState(h);
	if (err)
		return ej_error(ctx, EPJ_ERR_IO, "%s: read error", path);
	epj_hash128 r = { .lo = d.low64, .hi = d.high64 };
	epj_hash_hex(r, hex);
	*bytes = total;
	return EPJ_OK;
}

bool ej_ckpt_set_file_name(const char *path, int64_t gen, int rank, char *name,
			   size_t n)
{
	const char *sl = strrchr(path, '/');
	int k = snprintf(name, n, "%s.g%" PRId64 ".rank%d", sl ? sl + 1 : path,
			 gen, rank);
	return k > 0 && (size_t)k < n;
}

bool ej_ckpt_set_copy_path(const char *path, int64_t gen, char *buf, size_t n)
{
	int k = snprintf(buf, n, "%s.g%" PRId64 ".record", path, gen);
	return k > 0 && (size_t)k < n;
}

void ej_ckpt_set_prune(const char *path, const ej_ckpt_set *prev, int part,
		       int nparts)
{
	ej_path_parts pp;
	if (!prev || !prev->files || nparts < 1 || !ej_path_split(path, &pp))
		return;
	for (int64_t k = part; k < prev->world; k += nparts) {
		/* only a file that prev names under the name a save of this
		 * set gives it: a record cannot make us remove anything else */
		char want[EJ_CKPT_NAME_MAX], p[4096];
		struct stat sb;
		const char *nm = prev->files[k].name;
		if (!ej_ckpt_set_file_name(path, prev->generation, (int)k, want,
					   sizeof want) ||
		    strcmp(nm, want) != 0 ||
		    snprintf(p, sizeof p, "%s/%s", pp.dir, nm) >=
			(int)sizeof p ||
		    lstat(p, &sb) != 0 || !S_ISREG(sb.st_mode))
			continue;
		if (unlink(p) == 0)
			epj_log_msg(EPJ_LOG_INFO,
				    "removed %s: superseded by the newer "
				    "generation of %s",
				    p, path);
	}
	free(pp.buf);
}
