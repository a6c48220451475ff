/* safetensors.c -- reading and writing Hugging Face safetensors files.
 *
 * Layout (doc/formats.md): u64 little-endian N, N bytes of UTF-8 JSON
 * {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
 * "__metadata__": {str: str}}, then the data buffer; offsets are relative to
 * the buffer.  Reading follows HF's validation exactly, so a file opens here
 * iff HF's reader accepts it: N <= 100 MB and 8 + N <= file size; JSON
 * object without duplicate keys; sorted by offsets the tensors tile the
 * buffer with neither gap nor overlap and the last one ends at the end of
 * the file; every tensor's byte size is numel * dtype size (no overflow).
 * All of it is checked in epj_st_open, so epj_st_get only reads.
 *
 * Writing mirrors HF's serializer byte for byte: tensors ordered by dtype
 * (descending in HF's Dtype order, which is ascending alignment: I64, F64,
 * F32, I32, BF16) then by name, the header is compact JSON with
 * "__metadata__" first (keys sorted) and each entry's fields in the order
 * dtype, shape, data_offsets, padded with spaces to a multiple of 8 bytes so
 * every tensor's data is aligned to its element size.  Saves are atomic:
 * temp file, fsync, rename, fsync of the directory.
 *
 * Invariants: an epj_st_file's entries are sorted by name (binary search)
 * and have passed every check above; data_start = 8 + N.  The host is little
 * endian (static assert), so tensor bytes are the file's bytes.
 */
#include "core_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
	       "safetensors I/O assumes a little-endian host");

#define ST_MAX_HEADER 100000000ull /* HF's MAX_HEADER_SIZE */

/* ---- dtypes --------------------------------------------------------------
 * Every dtype HF's reader knows, so that files holding e.g. F16 buffers
 * still open (and validate); `dt` is EPJ_DTYPE_COUNT for those epjit cannot
 * hold.  `rank` is the position in HF's Dtype enum, used for the write
 * order. */
static const struct {
	const char *name;
	size_t size;
	epj_dtype dt;
	int rank;
} st_dtypes[] = {
	{ "BOOL", 1, EPJ_DTYPE_COUNT, 0 },
	{ "U8", 1, EPJ_DTYPE_COUNT, 1 },
	{ "I8", 1, EPJ_DTYPE_COUNT, 2 },
	{ "F8_E5M2", 1, EPJ_DTYPE_COUNT, 3 },
	{ "F8_E4M3", 1, EPJ_DTYPE_COUNT, 4 },
	{ "I16", 2, EPJ_DTYPE_COUNT, 5 },
	{ "U16", 2, EPJ_DTYPE_COUNT, 6 },
	{ "F16", 2, EPJ_DTYPE_COUNT, 7 },
	{ "BF16", 2, EPJ_DTYPE_BF16, 8 },
	{ "I32", 4, EPJ_DTYPE_I32, 9 },
	{ "U32", 4, EPJ_DTYPE_COUNT, 10 },
	{ "F32", 4, EPJ_DTYPE_F32, 11 },
	{ "F64", 8, EPJ_DTYPE_F64, 12 },
	{ "I64", 8, EPJ_DTYPE_I64, 13 },
	{ "U64", 8, EPJ_DTYPE_COUNT, 14 },
};

static int st_dtype_lookup(const char *name)
{
	for (int i = 0; i < (int)EJ_ARRAY_LEN(st_dtypes); i++)
		if (strcmp(st_dtypes[i].name, name) == 0)
			return i;
	return -1;
}

static int st_dtype_of(epj_dtype dt)
{
	for (int i = 0; i < (int)EJ_ARRAY_LEN(st_dtypes); i++)
		if (st_dtypes[i].dt == dt)
			return i;
	return -1;
}

/* ---- reading ----------------------------------------------------------- */

typedef struct st_entry {
	char *name;
	int dtype; /* index into st_dtypes */
	int ndim;
	int64_t *shape; /* ndim dims (malloc'ed; NULL when ndim == 0) */
	uint64_t begin, end;
	int part; /* the shard holding it (a set of shards), else 0 */
} st_entry;

struct epj_st_file {
	char *path;
	FILE *fp;
	uint64_t data_start; /* 8 + N */
	int n;
	st_entry *e; /* sorted by name */
	int n_meta;
	char **meta_key; /* sorted */
	char **meta_val;
	/* A set of shards (epj_st_open of a *.index.json): the shard files,
	 * each entry naming its own (st_entry.part); fp is NULL. */
	int n_parts;
	epj_st_file **parts;
};

#define ST_FMT(ctx, path, ...) st_error(ctx, EPJ_ERR_FORMAT, path, __VA_ARGS__)

static epj_status st_error(epj_ctx *ctx, epj_status s, const char *path,
			   const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* "safetensors '<path>': <message>" */
static epj_status st_error(epj_ctx *ctx, epj_status s, const char *path,
			   const char *fmt, ...)
{
	char msg[768];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return ej_error(ctx, s, "safetensors '%s': %s", path, msg);
}

static int entry_cmp_name(const void *a, const void *b)
{
	return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

static int entry_cmp_offsets(const void *a, const void *b)
{
	const st_entry *x = *(const st_entry *const *)a;
	const st_entry *y = *(const st_entry *const *)b;
	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	if (x->end != y->end)
		return x->end < y->end ? -1 : 1;
	return 0;
}

static int str_cmp_ptr(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A JSON value that must be a non-negative integer. */
static bool json_uint(const json_t *v, uint64_t *out)
{
	if (!json_is_integer(v) || json_integer_value(v) < 0)
		return false;
	*out = (uint64_t)json_integer_value(v);
	return true;
}

static epj_status parse_entry(epj_ctx *ctx, const char *path, const char *name,
			      json_t *v, st_entry *e)
{
	e->name = strdup(name);
	if (!e->name)
		return st_error(ctx, EPJ_ERR_NOMEM, path, "out of memory");
	if (!json_is_object(v))
		return ST_FMT(ctx, path, "entry '%s' is not an object", name);

	json_t *dt = json_object_get(v, "dtype");
	if (!dt)
		return ST_FMT(ctx, path, "entry '%s' has no \"dtype\"", name);
	if (!json_is_string(dt))
		return ST_FMT(ctx, path,
			      "entry '%s': \"dtype\" is not a string", name);
	e->dtype = st_dtype_lookup(json_string_value(dt));
	if (e->dtype < 0)
		return ST_FMT(ctx, path, "entry '%s': unknown dtype \"%s\"",
			      name, json_string_value(dt));

	json_t *shape = json_object_get(v, "shape");
	if (!shape)
		return ST_FMT(ctx, path, "entry '%s' has no \"shape\"", name);
	if (!json_is_array(shape))
		return ST_FMT(ctx, path,
			      "entry '%s': \"shape\" is not an array", name);
	e->ndim = (int)json_array_size(shape);
	if (e->ndim > 0) {
		e->shape = calloc((size_t)e->ndim, sizeof *e->shape);
		if (!e->shape)
			return st_error(ctx, EPJ_ERR_NOMEM, path,
					"out of memory");
	}
	uint64_t numel = 1, nonzero = 1;
	for (int i = 0; i < e->ndim; i++) {
		json_t *d = json_array_get(shape, (size_t)i);
		if (!json_is_integer(d))
			return ST_FMT(ctx, path,
				      "entry '%s': shape[%d] is not an integer",
				      name, i);
		if (json_integer_value(d) < 0)
			return ST_FMT(ctx, path,
				      "entry '%s': negative dimension "
				      "shape[%d] = %lld",
				      name, i,
				      (long long)json_integer_value(d));
		e->shape[i] = (int64_t)json_integer_value(d);
		if (__builtin_mul_overflow(numel, (uint64_t)e->shape[i],
					   &numel))
			return ST_FMT(ctx, path,
				      "entry '%s': element count overflows",
				      name);
		/* The non-zero dimensions bound the strides even when
		 * another dimension is 0 (tensor.c's limit). */
		if (e->shape[i] > 0 &&
		    (__builtin_mul_overflow(nonzero, (uint64_t)e->shape[i],
					    &nonzero) ||
		     nonzero > (uint64_t)(INT64_MAX / 8)))
			return ST_FMT(ctx, path,
				      "entry '%s': shape too large: the "
				      "product of the non-zero dimensions "
				      "must be at most %lld",
				      name, (long long)(INT64_MAX / 8));
	}
	uint64_t bytes;
	if (__builtin_mul_overflow(numel, (uint64_t)st_dtypes[e->dtype].size,
				   &bytes))
		return ST_FMT(ctx, path, "entry '%s': byte size overflows",
			      name);

	json_t *off = json_object_get(v, "data_offsets");
	if (!off)
		return ST_FMT(ctx, path, "entry '%s' has no \"data_offsets\"",
			      name);
	if (!json_is_array(off) || json_array_size(off) != 2 ||
	    !json_uint(json_array_get(off, 0), &e->begin) ||
	    !json_uint(json_array_get(off, 1), &e->end))
		return ST_FMT(ctx, path,
			      "entry '%s': \"data_offsets\" is not "
			      "[begin, end] of non-negative integers",
			      name);
	if (e->end < e->begin)
		return ST_FMT(ctx, path,
			      "entry '%s': data_offsets end %llu < begin %llu",
			      name, (unsigned long long)e->end,
			      (unsigned long long)e->begin);
	if (e->end - e->begin != bytes)
		return ST_FMT(ctx, path,
			      "entry '%s': data_offsets [%llu, %llu] hold %llu "
			      "bytes, but %s of %llu elements needs %llu",
			      name, (unsigned long long)e->begin,
			      (unsigned long long)e->end,
			      (unsigned long long)(e->end - e->begin),
			      st_dtypes[e->dtype].name,
			      (unsigned long long)numel,
			      (unsigned long long)bytes);
	return EPJ_OK;
}

static epj_status parse_metadata(epj_ctx *ctx, epj_st_file *f, json_t *m)
{
	if (!json_is_object(m))
		return ST_FMT(ctx, f->path,
			      "\"__metadata__\" is not an object");
	size_t n = json_object_size(m);
	f->meta_key = calloc(n + 1, sizeof *f->meta_key);
	f->meta_val = calloc(n + 1, sizeof *f->meta_val);
	if (!f->meta_key || !f->meta_val)
		return st_error(ctx, EPJ_ERR_NOMEM, f->path, "out of memory");
	const char *k;
	json_t *v;
	json_object_foreach(m, k, v)
	{
		if (!json_is_string(v))
			return ST_FMT(ctx, f->path,
				      "\"__metadata__\" value of '%s' is not a "
				      "string",
				      k);
		f->meta_key[f->n_meta] = strdup(k);
		f->meta_val[f->n_meta] = strdup(json_string_value(v));
		f->n_meta++;
		if (!f->meta_key[f->n_meta - 1] || !f->meta_val[f->n_meta - 1])
			return st_error(ctx, EPJ_ERR_NOMEM, f->path,
					"out of memory");
	}
	/* Sort keys; the values follow through a permutation of pairs. */
	char **pairs = malloc(2 * (size_t)f->n_meta * sizeof *pairs + 1);
	if (!pairs)
		return st_error(ctx, EPJ_ERR_NOMEM, f->path, "out of memory");
	for (int i = 0; i < f->n_meta; i++) {
		pairs[2 * i] = f->meta_key[i];
		pairs[2 * i + 1] = f->meta_val[i];
	}
	qsort(pairs, (size_t)f->n_meta, 2 * sizeof *pairs, str_cmp_ptr);
	for (int i = 0; i < f->n_meta; i++) {
		f->meta_key[i] = pairs[2 * i];
		f->meta_val[i] = pairs[2 * i + 1];
	}
	free(pairs);
	return EPJ_OK;
}

/* Checks that the tensors, sorted by offsets, tile [0, buffer_len). */
static epj_status check_tiling(epj_ctx *ctx, epj_st_file *f,
			       uint64_t buffer_len)
{
	st_entry **by_off = malloc(((size_t)f->n + 1) * sizeof *by_off);
	if (!by_off)
		return st_error(ctx, EPJ_ERR_NOMEM, f->path, "out of memory");
	for (int i = 0; i < f->n; i++)
		by_off[i] = &f->e[i];
	qsort(by_off, (size_t)f->n, sizeof *by_off, entry_cmp_offsets);
	epj_status s = EPJ_OK;
	uint64_t at = 0;
	const char *prev = NULL;
	for (int i = 0; i < f->n && s == EPJ_OK; i++) {
		const st_entry *e = by_off[i];
		if (e->begin < at)
			s = ST_FMT(ctx, f->path,
				   "tensor '%s' [%llu, %llu] overlaps tensor "
				   "'%s' (which ends at %llu)",
				   e->name, (unsigned long long)e->begin,
				   (unsigned long long)e->end, prev,
				   (unsigned long long)at);
		else if (e->begin > at)
			s = ST_FMT(ctx, f->path,
				   "gap of %llu bytes before tensor '%s' "
				   "(data_offsets must tile the buffer)",
				   (unsigned long long)(e->begin - at),
				   e->name);
		at = e->end;
		prev = e->name;
	}
	if (s == EPJ_OK && at > buffer_len)
		s = ST_FMT(ctx, f->path,
			   "truncated: tensors need a %llu-byte data buffer, "
			   "the file holds %llu",
			   (unsigned long long)at,
			   (unsigned long long)buffer_len);
	else if (s == EPJ_OK && at < buffer_len)
		s = ST_FMT(ctx, f->path,
			   "%llu trailing bytes after the last tensor (data "
			   "buffer %llu bytes, tensors end at %llu)",
			   (unsigned long long)(buffer_len - at),
			   (unsigned long long)buffer_len,
			   (unsigned long long)at);
	free(by_off);
	return s;
}

static epj_status parse_header(epj_ctx *ctx, epj_st_file *f, const char *hdr,
			       size_t n, uint64_t buffer_len)
{
	json_error_t jerr;
	json_t *root =
	    json_loadb(hdr, n, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
	if (!root)
		return ST_FMT(ctx, f->path,
			      "header is not valid JSON: %s (line %d, column "
			      "%d)",
			      jerr.text, jerr.line, jerr.column);
	epj_status s = EPJ_OK;
	if (!json_is_object(root)) {
		s = ST_FMT(ctx, f->path, "header is not a JSON object");
		goto out;
	}
	size_t cap = json_object_size(root);
	f->e = calloc(cap + 1, sizeof *f->e);
	if (!f->e) {
		s = st_error(ctx, EPJ_ERR_NOMEM, f->path, "out of memory");
		goto out;
	}
	const char *key;
	json_t *v;
	json_object_foreach(root, key, v)
	{
		if (strcmp(key, "__metadata__") == 0)
			s = parse_metadata(ctx, f, v);
		else
			s = parse_entry(ctx, f->path, key, v, &f->e[f->n++]);
		if (s != EPJ_OK)
			goto out;
	}
	qsort(f->e, (size_t)f->n, sizeof *f->e, entry_cmp_name);
	s = check_tiling(ctx, f, buffer_len);
out:
	json_decref(root);
	return s;
}

static epj_status open_index(epj_ctx *ctx, const char *path, epj_st_file **out);

static bool ends_with(const char *s, const char *suffix)
{
	size_t a = strlen(s), b = strlen(suffix);
	return a >= b && !strcmp(s + a - b, suffix);
}

epj_status epj_st_open(epj_ctx *ctx, const char *path, epj_st_file **out)
{
	if (!out)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_st_open: out is NULL");
	*out = NULL;
	if (!path)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_st_open: path is NULL");
	if (ends_with(path, ".index.json"))
		return open_index(ctx, path, out);
	epj_st_file *f = calloc(1, sizeof *f);
	if (!f || !(f->path = strdup(path))) {
		free(f);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"safetensors '%s': out of memory", path);
	}
	epj_status s = EPJ_OK;
	char *hdr = NULL;
	const char *why = NULL;
	f->fp = ej_fopen_regular(path, &why);
	if (!f->fp) {
		s = st_error(ctx, EPJ_ERR_IO, path, "cannot open: %s", why);
		goto fail;
	}
	struct stat st;
	if (fstat(fileno(f->fp), &st) != 0) {
		s = st_error(ctx, EPJ_ERR_IO, path, "stat: %s",
			     strerror(errno));
		goto fail;
	}
	if (!S_ISREG(st.st_mode)) {
		s = st_error(ctx, EPJ_ERR_IO, path, "not a regular file");
		goto fail;
	}
	uint64_t size = (uint64_t)st.st_size;
	if (size < 8) {
		s = ST_FMT(ctx, path,
			   "file is %llu bytes, shorter than the 8-byte header "
			   "length",
			   (unsigned long long)size);
		goto fail;
	}
	unsigned char len8[8];
	if (fread(len8, 1, 8, f->fp) != 8) {
		s = st_error(ctx, EPJ_ERR_IO, path, "read: %s",
			     ferror(f->fp) ? strerror(errno) : "short read");
		goto fail;
	}
	uint64_t n = 0;
	for (int i = 7; i >= 0; i--)
		n = n << 8 | len8[i];
	if (n > ST_MAX_HEADER) {
		s = ST_FMT(ctx, path,
			   "header length %llu exceeds the 100 MB limit",
			   (unsigned long long)n);
		goto fail;
	}
	if (n > size - 8) {
		s = ST_FMT(ctx, path,
			   "header length %llu is larger than the rest of the "
			   "file (%llu bytes)",
			   (unsigned long long)n,
			   (unsigned long long)(size - 8));
		goto fail;
	}
	hdr = malloc(n + 1);
	if (!hdr) {
		s = st_error(ctx, EPJ_ERR_NOMEM, path,
			     "out of memory for a %llu-byte header",
			     (unsigned long long)n);
		goto fail;
	}
	if (fread(hdr, 1, n, f->fp) != n) {
		s = st_error(ctx, EPJ_ERR_IO, path, "read header: %s",
			     ferror(f->fp) ? strerror(errno) : "short read");
		goto fail;
	}
	f->data_start = 8 + n;
	s = parse_header(ctx, f, hdr, n, size - 8 - n);
	if (s != EPJ_OK)
		goto fail;
	free(hdr);
	*out = f;
	return EPJ_OK;
fail:
	free(hdr);
	epj_st_close(f);
	return s;
}

void epj_st_close(epj_st_file *f)
{
	if (!f)
		return;
	if (f->fp)
		fclose(f->fp);
	for (int i = 0; i < f->n_parts; i++)
		epj_st_close(f->parts[i]);
	free(f->parts);
	for (int i = 0; i < f->n; i++) {
		free(f->e[i].name);
		free(f->e[i].shape);
	}
	free(f->e);
	for (int i = 0; i < f->n_meta; i++) {
		free(f->meta_key[i]);
		free(f->meta_val[i]);
	}
	free(f->meta_key);
	free(f->meta_val);
	free(f->path);
	free(f);
}

/* ---- a set of shards ---------------------------------------------------
 *
 * Hugging Face writes a large checkpoint as shards plus
 * model.safetensors.index.json: {"metadata": {...}, "weight_map": {tensor:
 * shard file}}.  Opened as one epj_st_file: every shard is opened and
 * validated as a file of its own, and the set holds the union of their
 * entries, each read from its shard.  A shard is a plain file name next to
 * the index (no '/', not starting with '.': an index cannot point outside
 * its folder); every tensor the index names must be in its shard, and every
 * tensor of a shard must be named by the index for that shard. */

#define ST_MAX_SHARDS 65536

static epj_status open_index(epj_ctx *ctx, const char *path, epj_st_file **out)
{
	const char *why = NULL;
	FILE *fp = ej_fopen_regular(path, &why);
	if (!fp)
		return st_error(ctx, EPJ_ERR_IO, path, "cannot open: %s", why);
	json_error_t jerr;
	json_t *root = json_loadf(fp, 0, &jerr);
	fclose(fp);
	if (!root)
		return ST_FMT(ctx, path, "invalid JSON at line %d: %s",
			      jerr.line, jerr.text);
	epj_status s = EPJ_OK;
	epj_st_file *f = calloc(1, sizeof *f);
	const char **shard = NULL; /* distinct shard names, in index order */
	json_t *wm = json_object_get(root, "weight_map");
	size_t n_names = json_is_object(wm) ? json_object_size(wm) : 0;
	if (!f || !(f->path = strdup(path))) {
		s = st_error(ctx, EPJ_ERR_NOMEM, path, "out of memory");
		goto out;
	}
	if (!json_is_object(wm) || n_names == 0) {
		s = ST_FMT(ctx, path,
			   "no \"weight_map\" object of tensor "
			   "names and shard files");
		goto out;
	}
	shard = calloc(n_names, sizeof *shard);
	f->parts = calloc(n_names, sizeof *f->parts);
	if (!shard || !f->parts) {
		s = st_error(ctx, EPJ_ERR_NOMEM, path, "out of memory");
		goto out;
	}
	const char *key;
	json_t *v;
	json_object_foreach(wm, key, v)
	{
		const char *sh = json_is_string(v) ? json_string_value(v) : "";
		if (!*sh || strchr(sh, '/') || sh[0] == '.' ||
		    strlen(sh) > 255) {
			s = ST_FMT(ctx, path,
				   "tensor '%s': shard '%.80s' is not a file "
				   "name next to the index",
				   key, sh);
			goto out;
		}
		int k = 0;
		while (k < f->n_parts && strcmp(shard[k], sh) != 0)
			k++;
		if (k == f->n_parts) {
			if (f->n_parts == ST_MAX_SHARDS) {
				s = ST_FMT(ctx, path, "more than %d shards",
					   ST_MAX_SHARDS);
				goto out;
			}
			shard[f->n_parts++] = sh;
		}
	}
	/* open every shard, next to the index */
	size_t dirlen =
	    strrchr(path, '/') ? (size_t)(strrchr(path, '/') - path + 1) : 0;
	size_t total = 0;
	for (int k = 0; k < f->n_parts; k++) {
		char *sp = malloc(dirlen + strlen(shard[k]) + 1);
		if (!sp) {
			s = st_error(ctx, EPJ_ERR_NOMEM, path, "out of memory");
			goto out;
		}
		memcpy(sp, path, dirlen);
		strcpy(sp + dirlen, shard[k]);
		s = epj_st_open(ctx, sp, &f->parts[k]);
		free(sp);
		if (s != EPJ_OK) {
			ej_error_prefix(ctx, "safetensors index '%s'", path);
			f->n_parts = k; /* the ones opened */
			goto out;
		}
		total += (size_t)f->parts[k]->n;
	}
	/* the union: each shard's tensors as the index lists them */
	if (total != n_names) {
		s = ST_FMT(ctx, path,
			   "the index names %zu tensors, its %d shards hold "
			   "%zu",
			   n_names, f->n_parts, total);
		goto out;
	}
	f->e = calloc(total, sizeof *f->e);
	if (!f->e) {
		s = st_error(ctx, EPJ_ERR_NOMEM, path, "out of memory");
		goto out;
	}
	for (int k = 0; k < f->n_parts; k++) {
		const epj_st_file *p = f->parts[k];
		for (int i = 0; i < p->n; i++) {
			json_t *w = json_object_get(wm, p->e[i].name);
			if (!json_is_string(w) ||
			    strcmp(json_string_value(w), shard[k]) != 0) {
				s = ST_FMT(ctx, path,
					   "tensor '%s' of shard '%s' is not "
					   "in the index under that shard",
					   p->e[i].name, shard[k]);
				goto out;
			}
			st_entry *e = &f->e[f->n];
			*e = p->e[i];
			e->part = k;
			e->name = strdup(p->e[i].name);
			e->shape = NULL;
			if (p->e[i].ndim > 0) {
				size_t sb =
				    sizeof *e->shape * (size_t)p->e[i].ndim;
				e->shape = malloc(sb);
				if (e->shape)
					memcpy(e->shape, p->e[i].shape, sb);
			}
			f->n++;
			if (!e->name || (p->e[i].ndim > 0 && !e->shape)) {
				s = st_error(ctx, EPJ_ERR_NOMEM, path,
					     "out of memory");
				goto out;
			}
		}
	}
	qsort(f->e, (size_t)f->n, sizeof *f->e, entry_cmp_name);
out:
	free(shard);
	json_decref(root);
	if (s != EPJ_OK) {
		epj_st_close(f);
		return s;
	}
	*out = f;
	return EPJ_OK;
}

int epj_st_count(const epj_st_file *f)
{
	return f ? f->n : 0;
}

static const st_entry *entry_at(const epj_st_file *f, int i)
{
	return f && i >= 0 && i < f->n ? &f->e[i] : NULL;
}

const char *epj_st_name_at(const epj_st_file *f, int i)
{
	const st_entry *e = entry_at(f, i);
	return e ? e->name : NULL;
}

int epj_st_find(const epj_st_file *f, const char *name)
{
	if (!f || !name)
		return -1;
	int lo = 0, hi = f->n - 1;
	while (lo <= hi) {
		int mid = lo + (hi - lo) / 2;
		int c = strcmp(name, f->e[mid].name);
		if (c == 0)
			return mid;
		if (c < 0)
			hi = mid - 1;
		else
			lo = mid + 1;
	}
	return -1;
}

const char *epj_st_dtype_str_at(const epj_st_file *f, int i)
{
	const st_entry *e = entry_at(f, i);
	return e ? st_dtypes[e->dtype].name : NULL;
}

epj_dtype epj_st_dtype_at(const epj_st_file *f, int i)
{
	const st_entry *e = entry_at(f, i);
	return e ? st_dtypes[e->dtype].dt : EPJ_DTYPE_COUNT;
}

int epj_st_ndim_at(const epj_st_file *f, int i)
{
	const st_entry *e = entry_at(f, i);
	return e ? e->ndim : -1;
}

const int64_t *epj_st_shape_at(const epj_st_file *f, int i)
{
	static const int64_t scalar[1] = { 0 };
	const st_entry *e = entry_at(f, i);
	if (!e)
		return NULL;
	return e->ndim ? e->shape : scalar;
}

epj_tensor *epj_st_get(epj_ctx *ctx, epj_st_file *f, const char *name)
{
	if (!f || !name) {
		ej_error(ctx, EPJ_ERR_INVALID, "epj_st_get: %s is NULL",
			 f ? "name" : "file");
		return NULL;
	}
	int i = epj_st_find(f, name);
	if (i < 0) {
		st_error(ctx, EPJ_ERR_INVALID, f->path, "no tensor named '%s'",
			 name);
		return NULL;
	}
	const st_entry *e = &f->e[i];
	/* a set of shards reads from the shard that holds the entry */
	epj_st_file *src = f->parts ? f->parts[e->part] : f;
	epj_dtype dt = st_dtypes[e->dtype].dt;
	if (dt == EPJ_DTYPE_COUNT) {
		st_error(ctx, EPJ_ERR_UNSUPPORTED, f->path,
			 "tensor '%s' has dtype %s, which epjit does not "
			 "support (F32, BF16, F64, I32, I64)",
			 name, st_dtypes[e->dtype].name);
		return NULL;
	}
	if (e->ndim > EPJ_MAX_DIMS) {
		st_error(ctx, EPJ_ERR_UNSUPPORTED, f->path,
			 "tensor '%s' has %d dimensions (at most %d)", name,
			 e->ndim, EPJ_MAX_DIMS);
		return NULL;
	}
	epj_tensor *t = ej_tensor_alloc(ctx, dt, e->ndim, e->shape, false);
	if (!t)
		return NULL;
	size_t bytes = (size_t)(e->end - e->begin);
	if (bytes == 0)
		return t;
	/* Read straight into host-visible storage, else through a bounce
	 * buffer copied to the device. */
	bool host = ctx->dev->host_visible;
	void *dst = host ? ej_data(t) : malloc(bytes);
	if (!dst) {
		epj_tensor_free(t);
		st_error(ctx, EPJ_ERR_NOMEM, f->path,
			 "out of memory reading '%s'", name);
		return NULL;
	}
	if (fseeko(src->fp, (off_t)(src->data_start + e->begin), SEEK_SET) !=
		0 ||
	    fread(dst, 1, bytes, src->fp) != bytes) {
		st_error(
		    ctx, EPJ_ERR_IO, src->path,
		    "reading tensor '%s' (%zu bytes at offset %llu): %s", name,
		    bytes, (unsigned long long)(src->data_start + e->begin),
		    ferror(src->fp) ? strerror(errno)
				    : "short read (file changed since open?)");
		clearerr(src->fp);
		if (!host)
			free(dst);
		epj_tensor_free(t);
		return NULL;
	}
	if (!host) {
		ctx->dev->copy(ctx->dev->self, ej_data(t), dst, bytes);
		free(dst);
	}
	return t;
}

const char *epj_st_metadata(const epj_st_file *f, const char *key)
{
	if (!f || !key)
		return NULL;
	for (int i = 0; i < f->n_meta; i++)
		if (strcmp(f->meta_key[i], key) == 0)
			return f->meta_val[i];
	return NULL;
}

int epj_st_metadata_count(const epj_st_file *f)
{
	return f ? f->n_meta : 0;
}

const char *epj_st_metadata_key_at(const epj_st_file *f, int i)
{
	return f && i >= 0 && i < f->n_meta ? f->meta_key[i] : NULL;
}

/* ---- writing ----------------------------------------------------------- */

typedef struct st_item {
	char *name;
	epj_tensor *t; /* owned reference */
	int dtype;     /* index into st_dtypes */
} st_item;

struct epj_st_writer {
	epj_ctx *ctx;
	int n, cap;
	st_item *items;
	int n_meta, cap_meta;
	char **meta_key;
	char **meta_val;
};

epj_status epj_st_writer_new(epj_ctx *ctx, epj_st_writer **out)
{
	if (!out)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_st_writer_new: out is NULL");
	*out = calloc(1, sizeof **out);
	if (!*out)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"epj_st_writer_new: out of memory");
	(*out)->ctx = ctx;
	return EPJ_OK;
}

void epj_st_writer_free(epj_st_writer *w)
{
	if (!w)
		return;
	for (int i = 0; i < w->n; i++) {
		free(w->items[i].name);
		epj_tensor_free(w->items[i].t);
	}
	free(w->items);
	for (int i = 0; i < w->n_meta; i++) {
		free(w->meta_key[i]);
		free(w->meta_val[i]);
	}
	free(w->meta_key);
	free(w->meta_val);
	free(w);
}

/* True when s is valid UTF-8 (jansson refuses anything else). */
static bool utf8_ok(const char *s)
{
	json_t *j = json_string(s);
	json_decref(j);
	return j != NULL;
}

epj_status epj_st_writer_add(epj_st_writer *w, const char *name, epj_tensor *t)
{
	if (!w)
		return EPJ_ERR_INVALID;
	epj_ctx *ctx = w->ctx;
	if (!t) {
		/* A failed op upstream already left its message: keep it. */
		if (ctx && ctx->status != EPJ_OK)
			return ctx->status;
		return ej_error(ctx, EPJ_ERR_INVALID,
				"safetensors writer: tensor '%s' is NULL",
				name ? name : "(null)");
	}
	if (!name)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"safetensors writer: name is NULL");
	if (strcmp(name, "__metadata__") == 0)
		return ej_error(
		    ctx, EPJ_ERR_INVALID,
		    "safetensors writer: '__metadata__' is reserved "
		    "and cannot name a tensor");
	if (!utf8_ok(name))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"safetensors writer: tensor name '%s' is not "
				"valid UTF-8",
				name);
	for (int i = 0; i < w->n; i++)
		if (strcmp(w->items[i].name, name) == 0)
			return ej_error(ctx, EPJ_ERR_INVALID,
					"safetensors writer: duplicate tensor "
					"name '%s'",
					name);
	if (!t->storage)
		return ej_error(ctx, EPJ_ERR_STATE,
				"safetensors writer: tensor '%s' is symbolic "
				"(trace mode) and has no data",
				name);
	int dt = st_dtype_of(t->dtype);
	EJ_ASSERT(dt >= 0);
	if (w->n == w->cap) {
		int cap = w->cap ? 2 * w->cap : 16;
		st_item *items = realloc(w->items, (size_t)cap * sizeof *items);
		if (!items)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"safetensors writer: out of memory");
		w->items = items;
		w->cap = cap;
	}
	char *copy = strdup(name);
	if (!copy)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"safetensors writer: out of memory");
	w->items[w->n++] = (st_item){ copy, epj_tensor_ref(t), dt };
	return EPJ_OK;
}

epj_status epj_st_writer_set_metadata(epj_st_writer *w, const char *key,
				      const char *value)
{
	if (!w)
		return EPJ_ERR_INVALID;
	epj_ctx *ctx = w->ctx;
	if (!key || !value)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"safetensors writer: metadata %s is NULL",
				key ? "value" : "key");
	if (!utf8_ok(key) || !utf8_ok(value))
		return ej_error(
		    ctx, EPJ_ERR_INVALID,
		    "safetensors writer: metadata '%s' is not valid "
		    "UTF-8",
		    key);
	char *v = strdup(value);
	if (!v)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"safetensors writer: out of memory");
	for (int i = 0; i < w->n_meta; i++)
		if (strcmp(w->meta_key[i], key) == 0) {
			free(w->meta_val[i]);
			w->meta_val[i] = v;
			return EPJ_OK;
		}
	if (w->n_meta == w->cap_meta) {
		int cap = w->cap_meta ? 2 * w->cap_meta : 8;
		char **k = realloc(w->meta_key, (size_t)cap * sizeof *k);
		if (k)
			w->meta_key = k;
		char **vv = realloc(w->meta_val, (size_t)cap * sizeof *vv);
		if (vv)
			w->meta_val = vv;
		if (!k || !vv) {
			free(v);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"safetensors writer: out of memory");
		}
		w->cap_meta = cap;
	}
	char *k = strdup(key);
	if (!k) {
		free(v);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"safetensors writer: out of memory");
	}
	w->meta_key[w->n_meta] = k;
	w->meta_val[w->n_meta] = v;
	w->n_meta++;
	return EPJ_OK;
}

/* Growable string for the header. */
typedef struct st_buf {
	char *p;
	size_t len, cap;
	bool oom;
} st_buf;

static void buf_put(st_buf *b, const char *s, size_t n)
{
	if (b->oom)
		return;
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 256;
		while (b->len + n + 1 > cap)
			cap *= 2;
		char *p = realloc(b->p, cap);
		if (!p) {
			b->oom = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

static void buf_puts(st_buf *b, const char *s)
{
	buf_put(b, s, strlen(s));
}

/* A JSON string literal (quotes and escapes) for s. */
static void buf_json_str(st_buf *b, const char *s)
{
	json_t *j = json_string(s);
	char *enc = j ? json_dumps(j, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
	json_decref(j);
	if (!enc) {
		b->oom = true;
		return;
	}
	buf_puts(b, enc);
	free(enc);
}

/* Write order: HF's — descending Dtype rank, then name (bytewise). */
static int item_cmp(const void *a, const void *b)
{
	const st_item *x = *(const st_item *const *)a;
	const st_item *y = *(const st_item *const *)b;
	int rx = st_dtypes[x->dtype].rank, ry = st_dtypes[y->dtype].rank;
	if (rx != ry)
		return rx > ry ? -1 : 1;
	return strcmp(x->name, y->name);
}

typedef struct st_save {
	epj_st_writer *w;
	const char *path;
	st_item **order;
	st_buf hdr; /* padded header */
} st_save;

/* Writes t's elements in row-major order (whatever its strides). */
static epj_status write_tensor(epj_ctx *ctx, FILE *fp, const char *tmp,
			       const char *path, const st_item *it)
{
	const epj_tensor *t = it->t;
	size_t es = ej_dtype_size(t->dtype);
	int64_t numel = ej_numel(t->ndim, t->shape);
	if (numel == 0)
		return EPJ_OK;
	/* Extent of storage the view touches, from element `offset`. */
	int64_t span = 1;
	for (int d = 0; d < t->ndim; d++)
		span += (t->shape[d] - 1) * t->stride[d];
	const char *src = ej_data(t);
	char *bounce = NULL;
	const ej_device *dev = t->ctx->dev;
	if (!dev->host_visible) {
		bounce = malloc((size_t)span * es);
		if (!bounce)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"safetensors '%s': out of memory "
					"copying '%s' to the host",
					path, it->name);
		dev->copy(dev->self, bounce, src, (size_t)span * es);
		src = bounce;
	}
	epj_status s = EPJ_OK;
	if (ej_is_contiguous(t)) {
		if (fwrite(src, es, (size_t)numel, fp) != (size_t)numel)
			s = EPJ_ERR_IO;
	} else {
		/* Row by row over the last dimension (rank 0 is contiguous). */
		int nd = t->ndim;
		int64_t rowlen = t->shape[nd - 1], rs = t->stride[nd - 1];
		char *row = malloc((size_t)rowlen * es);
		if (!row) {
			free(bounce);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"safetensors '%s': out of memory",
					path);
		}
		int64_t idx[EPJ_MAX_DIMS] = { 0 };
		for (int64_t r = 0; r < numel / rowlen && s == EPJ_OK; r++) {
			int64_t off = 0;
			for (int d = 0; d < nd - 1; d++)
				off += idx[d] * t->stride[d];
			for (int64_t j = 0; j < rowlen; j++)
				memcpy(row + (size_t)j * es,
				       src + (size_t)(off + j * rs) * es, es);
			if (fwrite(row, es, (size_t)rowlen, fp) !=
			    (size_t)rowlen)
				s = EPJ_ERR_IO;
			for (int d = nd - 2; d >= 0; d--) {
				if (++idx[d] < t->shape[d])
					break;
				idx[d] = 0;
			}
		}
		free(row);
	}
	free(bounce);
	if (s != EPJ_OK)
		return ej_error(
		    ctx, EPJ_ERR_IO,
		    "safetensors '%s': write '%s' (tensor '%s'): %s", path, tmp,
		    it->name, strerror(errno));
	return EPJ_OK;
}

static epj_status save_fill(epj_ctx *ctx, FILE *fp, const char *tmp, void *user)
{
	st_save *sv = user;
	unsigned char len8[8];
	uint64_t n = sv->hdr.len;
	for (int i = 0; i < 8; i++)
		len8[i] = (unsigned char)(n >> (8 * i));
	if (fwrite(len8, 1, 8, fp) != 8 ||
	    fwrite(sv->hdr.p, 1, sv->hdr.len, fp) != sv->hdr.len)
		return ej_error(ctx, EPJ_ERR_IO,
				"safetensors '%s': write '%s': %s", sv->path,
				tmp, strerror(errno));
	for (int i = 0; i < sv->w->n; i++) {
		epj_status s =
		    write_tensor(ctx, fp, tmp, sv->path, sv->order[i]);
		if (s != EPJ_OK)
			return s;
	}
	return EPJ_OK;
}

/* Metadata order: by key. */
static int meta_cmp(const void *a, const void *b)
{
	return strcmp(**(const char *const *const *)a,
		      **(const char *const *const *)b);
}

/* Sorts w's items into the file's order and builds its padded header
 * (sv->order, sv->hdr); an error (out of memory, a header past the limit)
 * is set in w's context.  st_save_done releases them. */
static epj_status st_save_prepare(epj_st_writer *w, const char *path,
				  st_save *sv)
{
	epj_ctx *ctx = w->ctx;
	*sv = (st_save){ .w = w, .path = path };
	sv->order = malloc(((size_t)w->n + 1) * sizeof *sv->order);
	/* mk[i] points at a key slot; its value is at the same index. */
	char ***mk = malloc(((size_t)w->n_meta + 1) * sizeof *mk);
	if (!sv->order || !mk) {
		free(mk);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"safetensors '%s': out of memory", path);
	}
	for (int i = 0; i < w->n; i++)
		sv->order[i] = &w->items[i];
	qsort(sv->order, (size_t)w->n, sizeof *sv->order, item_cmp);
	for (int i = 0; i < w->n_meta; i++)
		mk[i] = &w->meta_key[i];
	qsort(mk, (size_t)w->n_meta, sizeof *mk, meta_cmp);

	/* The header, exactly as serde_json writes HF's Metadata. */
	st_buf *b = &sv->hdr;
	char num[64];
	buf_puts(b, "{");
	if (w->n_meta > 0) {
		buf_puts(b, "\"__metadata__\":{");
		for (int i = 0; i < w->n_meta; i++) {
			if (i)
				buf_puts(b, ",");
			buf_json_str(b, *mk[i]);
			buf_puts(b, ":");
			buf_json_str(b, w->meta_val[mk[i] - w->meta_key]);
		}
		buf_puts(b, "}");
	}
	uint64_t offset = 0;
	for (int i = 0; i < w->n; i++) {
		const st_item *it = sv->order[i];
		const epj_tensor *t = it->t;
		if (i || w->n_meta > 0)
			buf_puts(b, ",");
		buf_json_str(b, it->name);
		buf_puts(b, ":{\"dtype\":\"");
		buf_puts(b, st_dtypes[it->dtype].name);
		buf_puts(b, "\",\"shape\":[");
		for (int d = 0; d < t->ndim; d++) {
			snprintf(num, sizeof num, d ? ",%lld" : "%lld",
				 (long long)t->shape[d]);
			buf_puts(b, num);
		}
		uint64_t bytes = (uint64_t)ej_numel(t->ndim, t->shape) *
				 ej_dtype_size(t->dtype);
		snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}",
			 (unsigned long long)offset,
			 (unsigned long long)(offset + bytes));
		buf_puts(b, num);
		offset += bytes;
	}
	buf_puts(b, "}");
	while (b->len % 8)
		buf_puts(b, " ");
	free(mk);
	if (b->oom)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"safetensors '%s': out of memory building the "
				"header",
				path);
	if (b->len > ST_MAX_HEADER)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"safetensors '%s': header of %zu bytes exceeds "
				"the 100 MB limit",
				path, b->len);
	return EPJ_OK;
}

static void st_save_done(st_save *sv)
{
	free(sv->hdr.p);
	free(sv->order);
}

epj_status epj_st_writer_save(epj_st_writer *w, const char *path)
{
	if (!w)
		return EPJ_ERR_INVALID;
	epj_ctx *ctx = w->ctx;
	if (!path)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"safetensors writer: path is NULL");
	st_save sv;
	epj_status s = st_save_prepare(w, path, &sv);
	if (s == EPJ_OK)
		s = ej_write_atomic(ctx, "safetensors", path, save_fill, &sv);
	st_save_done(&sv);
	return s;
}

epj_status ej_st_writer_write(epj_st_writer *w, FILE *fp, const char *path,
			      const char *tmp)
{
	st_save sv;
	epj_status s = st_save_prepare(w, path, &sv);
	if (s == EPJ_OK)
		s = save_fill(w->ctx, fp, tmp, &sv);
	st_save_done(&sv);
	return s;
}
