/* fake_nvrtc.c -- a pass-through in front of the real NVRTC that remembers
 * which CUDA C each image came from, so that the stand-in driver
 * (t/fake_cuda.c) can run a loaded module's kernels on cuda-sim without a
 * test installing a hook: the way a program that knows nothing of the
 * stand-in (bench-compile, bench-gpu, epjit-train) runs its kernels there.
 *
 *   LD_PRELOAD=t/.libs/libfakenvrtc.so EPJIT_CUDA_DRIVER=t/.libs/libfakecuda.so
 * ...
 *
 * nvrtcCreateProgram, nvrtcGetCUBIN, nvrtcGetPTX and nvrtcDestroyProgram
 * call the real ones (dlsym RTLD_NEXT) and are otherwise unchanged; after
 * an image is handed out, (its bytes, the program's source) is recorded.
 * fake_nvrtc_source_of(image, size) answers the source of an image with
 * exactly those bytes (NULL when none: an image from the kernel cache,
 * compiled by another process).  The library sees the real NVRTC.
 *
 * With FAKE_NVRTC_SOURCES=DIR the table also lives on disk: each image's
 * source is written to DIR/<size>-<hash>.cu (a temporary file renamed into
 * place, so concurrent writers never show a torn one), and a miss in the
 * table looks there.  Processes that share DIR and a kernel cache then run
 * each other's cached cubins: the ranks of one run, and the runs of a
 * test matrix, compile each kernel once instead of once per process.
 * With FAKE_NVRTC_LOG=FILE every program created appends one line, the
 * hash of its source, to FILE (O_APPEND): a test counts the compiles of
 * several processes and sees whether a source was compiled twice.
 *
 * Test code: built only for make check, never installed.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvrtcResult;
typedef struct _nvrtcProgram *nvrtcProgram;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* live programs and their sources */
static struct prog {
	nvrtcProgram p;
	char *src;
	struct prog *next;
} * progs;

/* images handed out */
static struct img {
	uint64_t hash;
	size_t size;
	char *src;
	struct img *next;
} * imgs;

static uint64_t fnv(const unsigned char *p, size_t n)
{
	uint64_t h = 1469598103934665603ull;
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 1099511628211ull;
	return h;
}

static void *real(const char *name)
{
	return dlsym(RTLD_NEXT, name);
}

nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src,
			       const char *name, int n, const char *const *h,
			       const char *const *inc);
nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src,
			       const char *name, int n, const char *const *h,
			       const char *const *inc)
{
	nvrtcResult (*f)(nvrtcProgram *, const char *, const char *, int,
			 const char *const *, const char *const *) = NULL;
	void *p = real("nvrtcCreateProgram");
	memcpy(&f, &p, sizeof p);
	if (!f)
		return 7; /* NVRTC_ERROR_INTERNAL_ERROR */
	nvrtcResult r = f(prog, src, name, n, h, inc);
	const char *log = getenv("FAKE_NVRTC_LOG");
	if (r == 0 && src && log && *log) {
		char line[32];
		int k = snprintf(line, sizeof line, "%016llx\n",
				 (unsigned long long)fnv(
				     (const unsigned char *)src, strlen(src)));
		int fd =
		    open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
		if (fd >= 0) {
			if (write(fd, line, (size_t)k) != k)
				(void)0; /* a test log: a short write shows */
			close(fd);
		}
	}
	if (r == 0 && src) {
		struct prog *e = calloc(1, sizeof *e);
		if (e && (e->src = strdup(src))) {
			e->p = *prog;
			pthread_mutex_lock(&lock);
			e->next = progs;
			progs = e;
			pthread_mutex_unlock(&lock);
		} else {
			free(e);
		}
	}
	return r;
}

/* DIR/<size>-<hash>.cu for FAKE_NVRTC_SOURCES=DIR, or 0 when unset. */
static int disk_path(char *buf, size_t n, uint64_t hash, size_t size)
{
	const char *dir = getenv("FAKE_NVRTC_SOURCES");
	if (!dir || !*dir)
		return 0;
	int k = snprintf(buf, n, "%s/%zu-%016llx.cu", dir, size,
			 (unsigned long long)hash);
	return k > 0 && (size_t)k < n;
}

/* Write src as the source of (hash, size) unless it is there already. */
static void disk_put(uint64_t hash, size_t size, const char *src)
{
	char path[4096], tmp[4200];
	if (!disk_path(path, sizeof path, hash, size) ||
	    access(path, F_OK) == 0)
		return;
	snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
	FILE *f = fopen(tmp, "wb");
	if (!f)
		return;
	size_t len = strlen(src);
	int ok = fwrite(src, 1, len, f) == len;
	ok = (fclose(f) == 0) && ok;
	if (!ok || rename(tmp, path) != 0)
		remove(tmp);
}

/* The source of (hash, size) from disk, or NULL. */
static char *disk_get(uint64_t hash, size_t size)
{
	char path[4096];
	if (!disk_path(path, sizeof path, hash, size))
		return NULL;
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	char *buf = NULL;
	if (fseek(f, 0, SEEK_END) == 0) {
		long len = ftell(f);
		if (len >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
		    (buf = malloc((size_t)len + 1))) {
			if (fread(buf, 1, (size_t)len, f) != (size_t)len) {
				free(buf);
				buf = NULL;
			} else {
				buf[len] = 0;
			}
		}
	}
	fclose(f);
	return buf;
}

/* After the image of prog was written to out (size bytes). */
static void remember(nvrtcProgram prog, const void *out, size_t size)
{
	pthread_mutex_lock(&lock);
	for (struct prog *e = progs; e; e = e->next) {
		if (e->p != prog)
			continue;
		struct img *m = calloc(1, sizeof *m);
		if (m && (m->src = strdup(e->src))) {
			m->hash = fnv(out, size);
			m->size = size;
			m->next = imgs;
			imgs = m;
			disk_put(m->hash, size, m->src);
		} else {
			free(m);
		}
		break;
	}
	pthread_mutex_unlock(&lock);
}

static nvrtcResult get_image(const char *get, const char *get_size,
			     nvrtcProgram prog, char *out)
{
	nvrtcResult (*f)(nvrtcProgram, char *) = NULL;
	nvrtcResult (*fs)(nvrtcProgram, size_t *) = NULL;
	void *p = real(get);
	memcpy(&f, &p, sizeof p);
	p = real(get_size);
	memcpy(&fs, &p, sizeof p);
	if (!f || !fs)
		return 7;
	nvrtcResult r = f(prog, out);
	size_t n = 0;
	if (r == 0 && fs(prog, &n) == 0 && n)
		remember(prog, out, n);
	return r;
}

nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin);
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin)
{
	return get_image("nvrtcGetCUBIN", "nvrtcGetCUBINSize", prog, cubin);
}

nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char *ptx);
nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char *ptx)
{
	return get_image("nvrtcGetPTX", "nvrtcGetPTXSize", prog, ptx);
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog);
nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog)
{
	nvrtcResult (*f)(nvrtcProgram *) = NULL;
	void *p = real("nvrtcDestroyProgram");
	memcpy(&f, &p, sizeof p);
	if (prog) {
		pthread_mutex_lock(&lock);
		for (struct prog **e = &progs; *e; e = &(*e)->next)
			if ((*e)->p == *prog) {
				struct prog *d = *e;
				*e = d->next;
				free(d->src);
				free(d);
				break;
			}
		pthread_mutex_unlock(&lock);
	}
	return f ? f(prog) : 7;
}

/* The source of the image image[0..size): a cubin's bytes, or a PTX text
 * with its NUL (as nvrtcGetPTXSize counts it and the stand-in driver
 * measures it), or NULL. */
const char *fake_nvrtc_source_of(const void *image, size_t size);
const char *fake_nvrtc_source_of(const void *image, size_t size)
{
	const char *src = NULL;
	uint64_t h = fnv(image, size);
	pthread_mutex_lock(&lock);
	for (struct img *m = imgs; m && !src; m = m->next)
		if (m->size == size && m->hash == h)
			src = m->src;
	if (!src) {
		/* another process's image, if it shared its sources */
		struct img *m = calloc(1, sizeof *m);
		if (m && (m->src = disk_get(h, size))) {
			m->hash = h;
			m->size = size;
			m->next = imgs;
			imgs = m;
			src = m->src;
		} else {
			free(m);
		}
	}
	pthread_mutex_unlock(&lock);
	return src;
}
