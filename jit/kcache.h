/* kcache.h -- the kernel cache: compiled artifacts (a cubin or a shared
 * object, opaque bytes here) plus their source text, stored under a key, in
 * a per-process memory table in front of a directory on disk.
 *
 * The cache knows nothing of the code generator: the caller computes a key
 * from everything that determines the artifact (ej_kcache_key), asks for it
 * (ej_kcache_get), and on a miss compiles and stores it (ej_kcache_put).
 *
 * Invariants
 *  - Nothing is read from a directory that is not owned by the effective user
 *    or is group- or world-writable, or that is a symbolic link (also given
 *    as "link/."), or below a directory that another user could rename
 *    (see kcache.c): ej_kcache_open fails instead (a cached module is code
 *    that will be executed); ej_kcache_open_for_run, what a run's builders
 *    call, then caches in a private directory of the process instead.
 *  - An entry on disk is either complete and verified (magic, key, lengths,
 *    XXH3-128 checksum over header, artifact and source; a regular file of
 *    the user that group and others cannot write) or treated as a miss: it
 *    is counted in cache.corrupt and removed, so the caller recompiles.
 *  - The disk is an optimization: a directory that cannot be created or an
 *    entry that cannot be written (read-only, full, something in the way)
 *    leaves a cache that works in memory (warned once per process, counted
 *    in cache.write_errors).  Only an insecure directory is an error.
 *  - Callers insert only artifacts that loaded and passed their checks.  A
 *    cached artifact that does not load is dropped by the caller
 *    (ej_kcache_drop_unloadable) and rebuilt: never an error for the run.
 *  - Entries appear on disk atomically (temporary file, fsync, rename), so any
 *    number of processes may put the same key into one directory at once.
 *  - One ej_kcache is used by one thread at a time (like its context); the
 *    on-disk cache is safe across threads and processes.
 * Layout and file format: doc/cache.md.
 */
#ifndef EPJIT_KCACHE_H
#define EPJIT_KCACHE_H

#include "core_impl.h"

#include <stddef.h>

/* A key is 64 lowercase hex digits (two XXH3-128 digests, see
 * ej_kcache_key); keys of any other form are refused (they name files). */
#define EJ_KCACHE_KEY_LEN 64

typedef struct ej_kcache ej_kcache;

/* Opens (creating with mode 0700 where missing) the cache directory `dir`;
 * dir NULL means the default: $EPJIT_CACHE_DIR, else $XDG_CACHE_HOME/epjit
 * (when absolute), else $HOME/.cache/epjit.  The size cap is
 * EPJIT_CACHE_MAX_MB MiB (default 1024).  Fails (NULL, error in ctx:
 * EPJ_ERR_STATE naming the directory and the reason) when the directory or
 * its v1/ subdirectory is a symbolic link, not owned by geteuid(), or group-
 * or world-writable, or when a directory above it may be replaced by
 * another user; EPJ_ERR_CONFIG for a malformed EPJIT_CACHE_MAX_MB.  A
 * directory that cannot be created or is not a directory gives a
 * memory-only cache (ej_kcache_on_disk false; warned once, counted in
 * cache.write_errors).  Temporary files of dead processes of this host are
 * removed (cache.stale_tmp_removed).  ctx is borrowed and receives the
 * cache.* counters; it must outlive the cache. */
ej_kcache *ej_kcache_open(epj_ctx *ctx, const char *dir);
/* As ej_kcache_open, for the builders of a run: a directory that
 * ej_kcache_open refuses (EPJ_ERR_STATE) does not stop the run.  Nothing is
 * read from it; the cache opens instead in the private directory of the
 * process, <TMPDIR>/epjit-kcache-<pid>.<host>-XXXXXX (made 0700 with
 * mkdtemp at the first refusal, shared by the later ones, removed at exit
 * by the process that made it; memory only if even that fails).  Each
 * refusal counts in cache.refused; the first of the process is warned
 * about in one line naming the reason and the directory used instead.
 * ej_kcache_refused tells the reason.  Other errors are ej_kcache_open's. */
ej_kcache *ej_kcache_open_for_run(epj_ctx *ctx, const char *dir);
/* Why the directory asked for was refused (ej_kcache_open_for_run), or NULL
 * when the cache is in that directory (or memory only for want of it). */
const char *ej_kcache_refused(const ej_kcache *c);
void ej_kcache_close(ej_kcache *c); /* NULL is fine */

/* The cache directory in use (resolved with realpath; as given for a
 * memory-only cache; owned by c). */
const char *ej_kcache_dir(const ej_kcache *c);
/* False when the cache degraded to memory only at open. */
bool ej_kcache_on_disk(const ej_kcache *c);
/* Replaces the size cap (bytes of entry files on disk; also bounds the
 * memory table).  EPJIT_CACHE_MAX_MB cannot express tiny caps: for tests. */
void ej_kcache_set_cap_bytes(ej_kcache *c, int64_t bytes);

/* Key of an artifact: 64 lowercase hex digits + NUL into out.  parts[0..n)
 * are everything the artifact depends on (graph signature, backend, arch,
 * compiler identity and version, flags, codegen version, template hash...);
 * a NULL part differs from "".  The parts are joined unambiguously: each one
 * as an 8-byte little-endian length (UINT64_MAX for NULL) followed by its
 * bytes; out is the hex of epj_hash(joined) followed by the hex of XXH3-128
 * with seed EJ_KCACHE_KEY_SEED2 of the same bytes. */
#define EJ_KCACHE_KEY_SEED2 0x65706a69746b6332ull /* "epjitkc2" */
void ej_kcache_key(char out[EJ_KCACHE_KEY_LEN + 1], const char *const *parts,
		   int n);

/* Looks key up: the memory table first (cache.mem_hits), then the disk
 * (cache.disk_hits; the entry's mtime is refreshed for LRU eviction and it
 * enters the memory table).  On a hit *data is a malloc'ed copy of the
 * artifact (the caller frees it with free()) and *len its size; on a miss
 * (cache.misses; also for a corrupt entry, which is removed and counted in
 * cache.corrupt) the call returns EPJ_OK with *data NULL and *len 0.
 * Errors: EPJ_ERR_INVALID for a malformed key, EPJ_ERR_IO when the entry
 * exists but cannot be read, EPJ_ERR_NOMEM. */
epj_status ej_kcache_get(ej_kcache *c, const char *key, void **data,
			 size_t *len);
/* Same, and when source is non-NULL *source receives a malloc'ed,
 * NUL-terminated copy of the stored source text on a hit (NULL on a miss). */
epj_status ej_kcache_get_with_source(ej_kcache *c, const char *key, void **data,
				     size_t *len, char **source);

/* Stores an artifact of len > 0 bytes (copied; an empty artifact is refused
 * with EPJ_ERR_INVALID so that *data NULL always means a miss) and its source
 * (NULL: none) under key, in the memory table and on disk, then evicts least
 * recently used entries while the disk holds more than the cap (never the
 * entry just written; cache.evictions).  cache.bytes counts the bytes of
 * entry files written.  A failed disk write (read-only, full disk, a
 * directory in the way) leaves no temporary file behind, keeps the memory
 * entry, counts cache.write_errors, warns once per process and returns
 * EPJ_OK; an insecure shard directory is EPJ_ERR_STATE. */
epj_status ej_kcache_put(ej_kcache *c, const char *key, const void *data,
			 size_t len, const char *source);

/* ---- what keys are made of (keys.c) -------------------------------------
 */

/* Key of a compiled artifact: the hash of `source` (the exact text handed
 * to the compiler), the compiler's identity and version, its flags and the
 * target (an NVRTC arch such as "sm_90", a host ISA; "" for none), under a
 * backend `kind` ("c", "nvrtc", ...).  NULL identity/flags/target differ
 * from "".  Every backend keys its artifacts with this function, so a
 * change anywhere in the generator that changes the source changes the
 * key. */
void ej_artifact_key(char out[EJ_KCACHE_KEY_LEN + 1], const char *kind,
		     const char *compiler_identity, const char *flags,
		     const char *target, const char *source);

/* The generator's build id: 32 hex digits hashing, at build time, the
 * sources of lib/, jit/ and templates/ (jit/build_id.h, made by make).  Part
 * of the key of anything cached above the generated source. */
const char *ej_build_id(void);
/* Takes the per-key lock DIR/v1/xx/<key>.lock (flock, exclusive), so that
 * of the processes that miss a key at once one compiles and the others wait
 * (cache.lock_waits counts the waits) and then find its entry: callers do
 * get, on a miss lock, get again, on a miss compile + load + check + put,
 * unlock.  A dead holder never blocks (the kernel drops its lock); a wait
 * longer than EPJIT_CACHE_LOCK_TIMEOUT seconds (default 600) gives up the
 * lock (warned, cache.lock_timeouts).  *lock is -1 when no lock could be
 * taken (memory-only cache, read-only directory: counted like a failed
 * write), which is still EPJ_OK.  Errors: EPJ_ERR_INVALID for a malformed
 * key, EPJ_ERR_STATE for an insecure shard directory. */
epj_status ej_kcache_lock(ej_kcache *c, const char *key, int *lock);
/* ej_kcache_get again after ej_kcache_lock: a hit is counted as usual, a
 * miss is not (the get before the lock counted it), so cache.misses stays
 * one per artifact built. */
epj_status ej_kcache_recheck(ej_kcache *c, const char *key, void **data,
			     size_t *len);
/* Releases a lock of ej_kcache_lock (-1 is fine). */
void ej_kcache_unlock(ej_kcache *c, int lock);
/* An artifact that ej_kcache_get handed out (data[0..len)) and that the
 * caller could not load (dlopen, cuModuleLoadData, a cuda-sim module: it
 * passed every check of the cache but is no code for this process, e.g.
 * built against another glibc, or imported with epjit-warmup --import):
 * removes it from the memory table and from disk (the file only while it
 * still holds these bytes, so an entry another process rebuilt meanwhile
 * stays), counts cache.unloadable and cache.misses (the compile that follows
 * is a miss's) and warns about the first of the process
 * (later ones at info level), naming the cache directory, the entry file and
 * `why` (the loader's message; may be the message of the cache's context).
 * The caller then compiles as on a miss and puts the new artifact; an
 * artifact it compiled itself that does not load stays its error. */
void ej_kcache_drop_unloadable(ej_kcache *c, const char *key, const void *data,
			       size_t len, const char *why);
/* The first half of that protocol for an artifact a device loads as a
 * module (dev->load): get; an entry that does not load is dropped
 * (ej_kcache_drop_unloadable, ctx's error cleared); on a miss take the
 * key's lock and look again, loading likewise.  On EPJ_OK *data is the
 * entry that loaded into *module (the caller frees it), or NULL: then *lock
 * is held (-1 when none could be taken) and the caller compiles, loads,
 * puts and releases it with ej_kcache_unlock in any case.  Errors are
 * ej_kcache_get's and ej_kcache_lock's. */
epj_status ej_kcache_get_module(ej_kcache *c, epj_ctx *ctx, const char *key,
				const ej_device *dev, const char *name,
				void **module, void **data, size_t *len,
				int *lock);
/* Calls fn(user, key, file_bytes) for every entry file on disk (any
 * order; the entries are not read or verified: ej_kcache_get does that).
 * Returns the number of entries (0 when the directory cannot be listed). */
typedef void (*ej_kcache_list_fn)(void *user, const char *key,
				  int64_t file_bytes);
int ej_kcache_list(ej_kcache *c, ej_kcache_list_fn fn, void *user);

#endif /* EPJIT_KCACHE_H */
