/* module.c -- the module tree: HF-style dotted names, children, parameters,
 * forward functions, and the one call path (ej_module_call) through which
 * activation checkpointing and graph breaks apply.
 *
 * Ownership: a parent owns its children; a module owns one reference on each
 * parameter and its impl state.  Names are computed once at creation.
 */
#include "runtime_impl.h"

#include <string.h>

static char *dupstr(const char *s)
{
	size_t n = strlen(s) + 1;
	char *d = malloc(n);
	if (d)
		memcpy(d, s, n);
	return d;
}

epj_module *ej_module_new(epj_module *parent, const char *local,
			  const char *kind, ej_forward_fn forward)
{
	epj_module *m = calloc(1, sizeof *m);
	if (!m)
		return NULL;
	m->local = dupstr(local ? local : "");
	if (parent && parent->name[0]) {
		size_t n =
		    strlen(parent->name) + strlen(m->local ? m->local : "") + 2;
		m->name = malloc(n);
		if (m->name)
			snprintf(m->name, n, "%s.%s", parent->name, m->local);
	} else {
		m->name = dupstr(m->local ? m->local : "");
	}
	if (!m->local || !m->name) {
		free(m->local);
		free(m->name);
		free(m);
		return NULL;
	}
	m->kind = kind;
	m->forward = forward;
	m->parent = parent;
	if (parent) {
		if (parent->n_children == parent->cap_children) {
			int nc =
			    parent->cap_children ? parent->cap_children * 2 : 4;
			epj_module **ch =
			    realloc(parent->children, sizeof *ch * (size_t)nc);
			if (!ch) {
				free(m->local);
				free(m->name);
				free(m);
				return NULL;
			}
			parent->children = ch;
			parent->cap_children = nc;
		}
		parent->children[parent->n_children++] = m;
	}
	return m;
}

void ej_module_free(epj_module *m)
{
	if (!m)
		return;
	for (int i = 0; i < m->n_children; i++)
		ej_module_free(m->children[i]);
	for (int i = 0; i < m->n_params; i++) {
		free(m->param_names[i]);
		epj_tensor_free(m->params[i]);
	}
	if (m->compiled_free)
		m->compiled_free(m->compiled);
	if (m->impl_free)
		m->impl_free(m->impl);
	free(m->children);
	free(m->param_names);
	free(m->params);
	free(m->name);
	free(m->local);
	free(m);
}

epj_tensor *ej_module_add_param(epj_module *m, const char *local, epj_tensor *t)
{
	if (!t)
		return NULL;
	ej_storage_mark_param(t); /* its bf16 f32 view: lib/wcache.c */
	if (m->n_params == m->cap_params) {
		int nc = m->cap_params ? m->cap_params * 2 : 4;
		char **nn = realloc(m->param_names, sizeof *nn * (size_t)nc);
		if (!nn)
			goto fail;
		m->param_names = nn;
		epj_tensor **np = realloc(m->params, sizeof *np * (size_t)nc);
		if (!np)
			goto fail;
		m->params = np;
		m->cap_params = nc;
	}
	m->param_names[m->n_params] = dupstr(local);
	if (!m->param_names[m->n_params])
		goto fail;
	m->params[m->n_params++] = t;
	epj_tensor_set_requires_grad(t, true);
	return t;
fail:
	epj_tensor_free(t);
	return NULL;
}

epj_tensor *ej_module_param(const epj_module *m, const char *local)
{
	for (int i = 0; i < m->n_params; i++)
		if (!strcmp(m->param_names[i], local))
			return m->params[i];
	return NULL;
}

epj_module *ej_module_child(const epj_module *m, const char *local)
{
	for (int i = 0; i < m->n_children; i++)
		if (!strcmp(m->children[i]->local, local))
			return m->children[i];
	return NULL;
}

int ej_module_walk(epj_module *root, ej_module_visit_fn fn, void *user)
{
	int r = fn(root, user);
	if (r)
		return r;
	for (int i = 0; i < root->n_children; i++) {
		r = ej_module_walk(root->children[i], fn, user);
		if (r)
			return r;
	}
	return 0;
}

typedef struct collect_state {
	epj_ctx *ctx;
	ej_param_list *l;
	int cap;
	epj_status st;
} collect_state;

static int collect_params(epj_module *m, void *user)
{
	collect_state *cs = user;
	ej_param_list *l = cs->l;
	for (int i = 0; i < m->n_params; i++) {
		if (l->n == cs->cap) {
			int nc = cs->cap ? cs->cap * 2 : 32;
			char **nn = realloc(l->names, sizeof *nn * (size_t)nc);
			if (nn)
				l->names = nn;
			epj_tensor **np =
			    realloc(l->params, sizeof *np * (size_t)nc);
			if (np)
				l->params = np;
			epj_module **no =
			    realloc(l->owners, sizeof *no * (size_t)nc);
			if (no)
				l->owners = no;
			if (!nn || !np || !no) {
				cs->st = ej_error(cs->ctx, EPJ_ERR_NOMEM,
						  "out of memory listing "
						  "parameters");
				return 1;
			}
			cs->cap = nc;
		}
		size_t n = strlen(m->name) + strlen(m->param_names[i]) + 2;
		char *full = malloc(n);
		if (!full) {
			cs->st = ej_error(cs->ctx, EPJ_ERR_NOMEM,
					  "out of memory listing parameters");
			return 1;
		}
		if (m->name[0])
			snprintf(full, n, "%s.%s", m->name, m->param_names[i]);
		else
			snprintf(full, n, "%s", m->param_names[i]);
		l->names[l->n] = full;
		l->params[l->n] = m->params[i];
		l->owners[l->n] = m;
		l->n++;
	}
	return 0;
}

epj_status ej_module_params(epj_ctx *ctx, epj_module *root, ej_param_list *out)
{
	memset(out, 0, sizeof *out);
	collect_state cs = { .ctx = ctx, .l = out, .st = EPJ_OK };
	ej_module_walk(root, collect_params, &cs);
	if (cs.st != EPJ_OK)
		ej_param_list_free(out);
	return cs.st;
}

void ej_param_list_free(ej_param_list *l)
{
	for (int i = 0; i < l->n; i++)
		free(l->names[i]);
	free(l->names);
	free(l->params);
	free(l->owners);
	memset(l, 0, sizeof *l);
}

void ej_set_break_hook(epj_ctx *ctx, const ej_break_hook *hook)
{
	ctx->rt_break_hook = hook;
}

const ej_break_hook *ej_get_break_hook(const epj_ctx *ctx)
{
	return ctx->rt_break_hook;
}

epj_status ej_module_call(epj_ctx *ctx, epj_module *m, epj_tensor *const *in,
			  int n_in, epj_tensor **out, int n_out)
{
	for (int j = 0; j < n_out; j++)
		out[j] = NULL;
	if (!m->forward)
		return ej_error(ctx, EPJ_ERR_STATE,
				"module \"%s\" (%s) has no forward", m->name,
				m->kind);
	for (int i = 0; i < n_in; i++)
		if (!in[i])
			return ctx->status != EPJ_OK
				   ? ctx->status
				   : ej_error(ctx, EPJ_ERR_INVALID,
					      "module \"%s\": input %d is NULL",
					      m->name, i);
	/* While tracing, a compiler_disabled module (the AutoEP layer) and a
	 * checkpointed module met inside a traced graph (full-model compile of
	 * a model with checkpointed blocks) become graph breaks: they run
	 * eagerly at run time, the latter with its checkpointing intact. */
	const ej_break_hook *hook = ej_get_break_hook(ctx);
	if (ctx->recorder && hook && (m->compiler_disabled || m->checkpoint))
		return hook->on_call(hook->self, ctx, m, in, n_in, out, n_out);
	epj_status st;
	if (m->checkpoint && !ctx->recorder && epj_grad_enabled(ctx) &&
	    !ej_in_replay(ctx))
		st = ej_checkpoint_call(ctx, m, in, n_in, out, n_out);
	else
		st = m->forward(ctx, m, in, n_in, out, n_out);
	if (st != EPJ_OK) {
		for (int j = 0; j < n_out; j++) {
			epj_tensor_free(out[j]);
			out[j] = NULL;
		}
	}
	return st;
}
