/* kcache_archive.h -- kernel-cache archives: entries of one cache written to
 * one file (with the identities of the compilers that built them) and
 * imported, verified, into another cache (epjit-warmup --export/--import).
 * The format is in doc/cache.md and at the top of kcache_archive.c.
 *
 * Trust.  An archive is checked for integrity (a checksum per entry and
 * one over the file) and every key is recomputed from the entry's source
 * and this machine's compiler identity, so a corrupt, truncated or
 * mislabelled archive is refused; it is not authenticated: an archive is
 * code, import only archives you would run.
 */
#ifndef EPJIT_KCACHE_ARCHIVE_H
#define EPJIT_KCACHE_ARCHIVE_H

#include "kcache.h"

/* The generator build id recorded in archives: epjit's version, the code
 * generator version and a hash of the C and CUDA preludes (static). */
const char *ej_kcache_generator_id(void);

/* ctx is the context c was opened with (errors go there).
 *
 * Writes the entries keys[0..n_keys) of c (n_keys < 0: every entry on
 * disk) to path (atomically: temporary file + rename).  An entry is written
 * only when its key can be recomputed here from its source (C: this host
 * compiler; NVRTC: this NVRTC, one of the known archs): others were built
 * by another compiler and are skipped with a warning.  A listed key that is
 * missing from the cache is an error (EPJ_ERR_STATE naming it).
 * *n_written: entries in the archive. */
epj_status ej_kcache_archive_export(epj_ctx *ctx, ej_kcache *c,
				    const char *path, const char *const *keys,
				    int n_keys, int *n_written);
/* The same, writing only the entries of one kind (only_kind "c" or
 * "nvrtc"; NULL: every kind): an archive of cubins alone imports on a
 * machine whose host compiler differs (a GPU machine). */
epj_status ej_kcache_archive_export_kind(epj_ctx *ctx, ej_kcache *c,
					 const char *path,
					 const char *const *keys, int n_keys,
					 const char *only_kind, int *n_written);

/* Reads path, verifies the file checksum and, for every entry, its
 * checksum, that it was built with this host compiler / this NVRTC / this
 * generator build, for an arch of EPJIT_CUDA_ARCH (default sm_80,sm_90),
 * and that its key is the one its source gives here; only when every entry
 * passes are they put into c.  Errors (nothing imported): EPJ_ERR_IO
 * (unreadable), EPJ_ERR_FORMAT (not an archive, truncated, corrupt, key
 * mismatch), EPJ_ERR_UNSUPPORTED (built for another compiler, NVRTC, arch
 * or generator), each naming the entry.  *n_added: entries stored;
 * *n_present: entries the cache already had. */
epj_status ej_kcache_archive_import(epj_ctx *ctx, ej_kcache *c,
				    const char *path, int *n_added,
				    int *n_present);

#endif /* EPJIT_KCACHE_ARCHIVE_H */
