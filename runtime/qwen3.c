/* qwen3.c -- the Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2/V3 and
 * Qwen3.5-MoE causal LMs, written with epj_* ops so that eager execution
 * mirrors the Hugging Face reference code op for op.  The families share the
 * block.  DeepSeek replaces the attention by multi-head latent attention
 * (mla_attention), makes its first first_k_dense_replace layers dense, adds
 * ungated mlp.shared_experts (region_owned, as Qwen2's shared expert) and
 * routes as its own routers do (runtime/autoep.c, route_scored); the rope
 * tables of every family honour linear and YaRN scaling.  Qwen3.5-MoE's
 * linear-attention layers are Gated DeltaNet (runtime/deltanet.c), its
 * full attention gates its output and ropes part of each head, and its
 * norms are zero-centred (norm_of).  Mixtral has no q/k norm,
 * names its MoE block block_sparse_moe with experts w1 (gate), w3 (up), w2
 * (down), always renormalises the top-k weights and refuses a sequence
 * longer than its sliding_window.  Qwen2-MoE has no q/k norm, q/k/v
 * projections with bias, and in every MoE layer a shared expert
 * (mlp.shared_expert, gated by sigmoid(x mlp.shared_expert_gate^T)) that
 * the block adds to the routed experts' output (region_owned: dense work of
 * the compiled region, under the MoE block's name):
 *
 *   input_ids [B,T] -> embed_tokens -> N x decoder block -> norm -> lm_head
 *   -> logits [B,T,V] -> cross-entropy(labels) -> loss []
 *
 * Packed documents (ej_model_forward_docs): position ids [B,T] pick the
 * rows of the rope tables (cos/sin [B,1,T,D] instead of [T,D]) and
 * document ids [B,T] reach every attention (epj_sdpa_docs); both are
 * inputs of the forward, so a compiled region serves any boundaries.
 *
 *   decoder block (h [B,T,H]):
 *     x = input_layernorm(h)                          RMSNorm (f32 inside)
 *     q = q_norm(q_proj(x).view(B,T,Hq,D)).transpose(1,2)   [B,Hq,T,D]
 *     k = k_norm(k_proj(x).view(B,T,Hkv,D)).transpose(1,2)  [B,Hkv,T,D]
 *     v = v_proj(x).view(B,T,Hkv,D).transpose(1,2)
 *     q, k = rope(q), rope(k)        x*cos + rotate_half(x)*sin
 *     a = o_proj(sdpa(q, k, v, causal).transpose(1,2).reshape(B,T,Hq*D))
 *     h = h + a
 *     h = h + mlp(post_attention_layernorm(h))   mlp: AutoEP (MoE) or dense
 *
 * Layouts.  nested: HF names; the root (Qwen3MoeForCausalLM) owns "model"
 * (container: embed_tokens, layers, norm) and "lm_head"; model.layers is a
 * ModuleList (no forward); model.layers.N is the decoder block whose forward
 * takes (h, cos, sin[, doc_ids]); model.layers.N.mlp is the AutoEP layer.
 * The root takes (input_ids[, labels[, position_ids][, doc_ids]]), the
 * last two as the model's docs_pos and docs_attn say.  root: a
 * single block; the root module itself owns embed_tokens, self_attn, the
 * norms, mlp (AutoEP) and lm_head and does everything in its own forward.
 */
#include "jit.h"
#include "router_loss_impl.h"
#include "runtime_impl.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

/* The module kinds and checkpoint names of a family. */
typedef struct family_names {
	const char *lm, *model, *layer, *attn, *norm, *root_lm, *dense_kind;
	const char *mlp;	 /* the block's MLP / MoE child */
	const char *expert_kind; /* an expert of the AutoEP layer */
	const char *proj[3];	 /* an expert's gate, up, down */
} family_names;

static const family_names qwen3_names = {
	"Qwen3MoeForCausalLM",	"Qwen3MoeModel",
	"Qwen3MoeDecoderLayer", "Qwen3MoeAttention",
	"Qwen3MoeRMSNorm",	"Qwen3MoeRootBlockLM",
	"Qwen3MoeMLP",		"mlp",
	"Qwen3MoeMLP",		{ "gate_proj", "up_proj", "down_proj" },
};

static const family_names mixtral_names = {
	"MixtralForCausalLM", "MixtralModel",	  "MixtralDecoderLayer",
	"MixtralAttention",   "MixtralRMSNorm",	  "MixtralRootBlockLM",
	"MixtralMLP",	      "block_sparse_moe", "MixtralBlockSparseTop2MLP",
	{ "w1", "w3", "w2" },
};

static const family_names qwen2_names = {
	"Qwen2MoeForCausalLM",	"Qwen2MoeModel",
	"Qwen2MoeDecoderLayer", "Qwen2MoeAttention",
	"Qwen2MoeRMSNorm",	"Qwen2MoeRootBlockLM",
	"Qwen2MoeMLP",		"mlp",
	"Qwen2MoeMLP",		{ "gate_proj", "up_proj", "down_proj" },
};

static const family_names deepseek_v2_names = {
	"DeepseekV2ForCausalLM",  "DeepseekV2Model",
	"DeepseekV2DecoderLayer", "DeepseekV2Attention",
	"DeepseekV2RMSNorm",	  "DeepseekV2RootBlockLM",
	"DeepseekV2MLP",	  "mlp",
	"DeepseekV2MLP",	  { "gate_proj", "up_proj", "down_proj" },
};

static const family_names deepseek_v3_names = {
	"DeepseekV3ForCausalLM",  "DeepseekV3Model",
	"DeepseekV3DecoderLayer", "DeepseekV3Attention",
	"DeepseekV3RMSNorm",	  "DeepseekV3RootBlockLM",
	"DeepseekV3MLP",	  "mlp",
	"DeepseekV3MLP",	  { "gate_proj", "up_proj", "down_proj" },
};

static const family_names qwen3_5_names = {
	"Qwen3_5MoeForCausalLM",  "Qwen3_5MoeTextModel",
	"Qwen3_5MoeDecoderLayer", "Qwen3_5MoeAttention",
	"Qwen3_5MoeRMSNorm",	  "Qwen3_5MoeRootBlockLM",
	"Qwen3_5MoeMLP",	  "mlp",
	"Qwen3_5MoeMLP",	  { "gate_proj", "up_proj", "down_proj" },
};

static const family_names *names_of(const ej_model_config *c)
{
	switch (c->family) {
	case EJ_FAMILY_QWEN3_5_MOE:
		return &qwen3_5_names;
	case EJ_FAMILY_MIXTRAL:
		return &mixtral_names;
	case EJ_FAMILY_QWEN2_MOE:
		return &qwen2_names;
	case EJ_FAMILY_DEEPSEEK_V2:
		return &deepseek_v2_names;
	case EJ_FAMILY_DEEPSEEK_V3:
		return &deepseek_v3_names;
	case EJ_FAMILY_QWEN3_MOE:
		break;
	}
	return &qwen3_names;
}

/* Frees a list of temporaries (NULL ok). */
void ej_drop(epj_tensor **ts, int n)
{
	for (int i = 0; i < n; i++) {
		epj_tensor_free(ts[i]);
		ts[i] = NULL;
	}
}

/* x.c * rsqrt(mean(x.c^2, -1) + eps) in the compute dtype c (f32 for
 * 16-bit x, else x's own): the normalised x of both RMSNorms below. */
static epj_tensor *rms_hat(epj_ctx *ctx, epj_tensor *x, double eps, bool *up)
{
	enum { XF, SQ, VAR, VE, RS, N_T };
	epj_tensor *t[N_T] = { 0 };
	epj_dtype dt = x ? epj_tensor_dtype(x) : EPJ_DTYPE_F32;
	*up = dt != EPJ_DTYPE_F32 && dt != EPJ_DTYPE_F64;
	t[XF] = *up ? epj_cast(ctx, x, EPJ_DTYPE_F32) : epj_tensor_ref(x);
	t[SQ] = epj_pow_scalar(ctx, t[XF], 2.0);
	t[VAR] = epj_mean(ctx, t[SQ], -1, true);
	t[VE] = epj_add_scalar(ctx, t[VAR], eps);
	t[RS] = epj_rsqrt(ctx, t[VE]);
	epj_tensor *y = epj_mul(ctx, t[XF], t[RS]);
	ej_drop(t, N_T);
	return y;
}

epj_tensor *ej_rmsnorm(epj_ctx *ctx, epj_tensor *x, epj_tensor *w, double eps)
{
	bool up;
	epj_tensor *nx = rms_hat(ctx, x, eps, &up);
	epj_tensor *nc =
	    up ? epj_cast(ctx, nx, epj_tensor_dtype(x)) : epj_tensor_ref(nx);
	epj_tensor *y = epj_mul(ctx, w, nc);
	epj_tensor_free(nx);
	epj_tensor_free(nc);
	return y;
}

epj_tensor *ej_rmsnorm_offset(epj_ctx *ctx, epj_tensor *x, epj_tensor *w,
			      double eps)
{
	enum { NX, WF, W1, Y, N_T };
	epj_tensor *t[N_T] = { 0 };
	bool up;
	t[NX] = rms_hat(ctx, x, eps, &up);
	epj_dtype cd = t[NX] ? epj_tensor_dtype(t[NX]) : EPJ_DTYPE_F32;
	t[WF] = w && epj_tensor_dtype(w) != cd ? epj_cast(ctx, w, cd)
					       : epj_tensor_ref(w);
	t[W1] = epj_add_scalar(ctx, t[WF], 1.0);
	t[Y] = epj_mul(ctx, t[NX], t[W1]);
	epj_tensor *y = up && t[Y] ? epj_cast(ctx, t[Y], epj_tensor_dtype(x))
				   : epj_tensor_ref(t[Y]);
	ej_drop(t, N_T);
	return y;
}

/* The family's RMSNorm of x with the weight of module norm: Qwen3.5's is
 * zero-centred (1 + w). */
static epj_tensor *norm_of(epj_ctx *ctx, const ej_model_config *c,
			   epj_tensor *x, epj_module *norm)
{
	epj_tensor *w = ej_module_param(norm, "weight");
	return c->norm_offset ? ej_rmsnorm_offset(ctx, x, w, c->rms_norm_eps)
			      : ej_rmsnorm(ctx, x, w, c->rms_norm_eps);
}

/* The dimensions the rope rotates: the first rotary_dim of a head
 * (Qwen3.5's partial rope), else all of head_dim (DeepSeek: the rope
 * part, its head_dim). */
static int64_t rope_dim(const ej_model_config *c)
{
	return c->rotary_dim ? c->rotary_dim : c->head_dim;
}

/* rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]) */
static epj_tensor *rope(epj_ctx *ctx, epj_tensor *x, epj_tensor *cos,
			epj_tensor *sin)
{
	enum { X1, X2, NX2, ROT, XC, RS, N_T };
	epj_tensor *t[N_T] = { 0 };
	int64_t d = x ? epj_tensor_dim(x, -1) : 0;
	t[X1] = epj_slice(ctx, x, -1, 0, d / 2, 1);
	t[X2] = epj_slice(ctx, x, -1, d / 2, d, 1);
	t[NX2] = epj_neg(ctx, t[X2]);
	epj_tensor *parts[2] = { t[NX2], t[X1] };
	t[ROT] = (t[NX2] && t[X1]) ? epj_cat(ctx, parts, 2, -1) : NULL;
	t[XC] = epj_mul(ctx, x, cos);
	t[RS] = epj_mul(ctx, t[ROT], sin);
	epj_tensor *y = epj_add(ctx, t[XC], t[RS]);
	ej_drop(t, N_T);
	return y;
}

/* DeepSeek's rope over interleaved pairs (x0, x1), (x2, x3) ..., as
 * transformers' apply_rotary_pos_emb_interleave writes it: with c, s the
 * first half of cos, sin (one angle per pair) and x1 = x[..., 0::2],
 * x2 = x[..., 1::2]: cat(x1 c - x2 s, x2 c + x1 s).  (DeepSeek-V2's
 * complex rotation gives the same pairs interleaved; q and k permuted
 * alike leave every attention score, so every value, unchanged.) */
static epj_tensor *rope_interleaved(epj_ctx *ctx, epj_tensor *x,
				    epj_tensor *cos, epj_tensor *sin)
{
	enum { C, S, X1, X2, A, B, LO, D, E, HI, N_T };
	epj_tensor *t[N_T] = { 0 };
	int64_t d = x ? epj_tensor_dim(x, -1) : 0;
	t[C] = epj_slice(ctx, cos, -1, 0, d / 2, 1);
	t[S] = epj_slice(ctx, sin, -1, 0, d / 2, 1);
	t[X1] = epj_slice(ctx, x, -1, 0, d, 2);
	t[X2] = epj_slice(ctx, x, -1, 1, d, 2);
	t[A] = epj_mul(ctx, t[X1], t[C]);
	t[B] = epj_mul(ctx, t[X2], t[S]);
	t[LO] = epj_sub(ctx, t[A], t[B]);
	t[D] = epj_mul(ctx, t[X2], t[C]);
	t[E] = epj_mul(ctx, t[X1], t[S]);
	t[HI] = epj_add(ctx, t[D], t[E]);
	epj_tensor *parts[2] = { t[LO], t[HI] };
	epj_tensor *y = (t[LO] && t[HI]) ? epj_cat(ctx, parts, 2, -1) : NULL;
	ej_drop(t, N_T);
	return y;
}

/* rope on the first rd dimensions of x (all of them when rd is x's last
 * dimension), the rest passed through: Qwen3.5's partial rope */
static epj_tensor *rope_part(epj_ctx *ctx, epj_tensor *x, epj_tensor *cos,
			     epj_tensor *sin, int64_t rd)
{
	int64_t d = x ? epj_tensor_dim(x, -1) : 0;
	if (!x || rd >= d)
		return rope(ctx, x, cos, sin);
	epj_tensor *t[3] = { 0 };
	t[0] = epj_slice(ctx, x, -1, 0, rd, 1);
	t[1] = epj_slice(ctx, x, -1, rd, d, 1);
	t[2] = rope(ctx, t[0], cos, sin);
	epj_tensor *parts[2] = { t[2], t[1] };
	epj_tensor *y = t[2] && t[1] ? epj_cat(ctx, parts, 2, -1) : NULL;
	ej_drop(t, 3);
	return y;
}

epj_tensor *ej_linear_of(epj_ctx *ctx, epj_module *lin, epj_tensor *x)
{
	return epj_linear(ctx, x, ej_module_param(lin, "weight"),
			  ej_module_param(lin, "bias"));
}

static epj_tensor *swiglu(epj_ctx *ctx, epj_module *m, epj_tensor *x);

/* [B,T,H*D] -> per-head norm (optional) -> [B,H,T,D] */
static epj_tensor *heads(epj_ctx *ctx, epj_tensor *p, int64_t nh, int64_t d,
			 epj_module *norm, const ej_model_config *c)
{
	epj_tensor *t[3] = { 0 };
	int64_t shp[4] = { p ? epj_tensor_dim(p, 0) : 0,
			   p ? epj_tensor_dim(p, 1) : 0, nh, d };
	t[0] = epj_reshape(ctx, p, 4, shp);
	t[1] = norm ? norm_of(ctx, c, t[0], norm) : epj_tensor_ref(t[0]);
	epj_tensor *y = t[1] ? epj_transpose(ctx, t[1], 1, 2) : NULL;
	ej_drop(t, 3);
	return y;
}

static const ej_model_config *cfg_of(epj_module *m)
{
	/* every block's impl points at the model config */
	while (m && !m->impl)
		m = m->parent;
	EJ_ASSERT(m);
	return m->impl;
}

/* Attention sub-block: x normalised [B,T,H] -> o_proj output [B,T,H]. */
static epj_tensor *attention(epj_ctx *ctx, epj_module *attn,
			     const ej_model_config *cfg, epj_tensor *x,
			     epj_tensor *cos, epj_tensor *sin, epj_tensor *docs)
{
	enum {
		QG,
		QG4,
		QH,
		GH,
		QP,
		KP,
		VP,
		Q,
		K,
		V,
		QR,
		KR,
		O,
		OT,
		OR,
		GR,
		GS,
		OG,
		N_T
	};
	epj_tensor *t[N_T] = { 0 };
	int64_t hq = cfg->num_attention_heads, hkv = cfg->num_key_value_heads;
	int64_t d = cfg->head_dim;
	int64_t B = x ? epj_tensor_dim(x, 0) : 0,
		T = x ? epj_tensor_dim(x, 1) : 0;
	int64_t shp[3] = { B, T, hq * d };
	if (cfg->attn_output_gate) {
		/* Qwen3.5: q_proj gives each head's query and its output
		 * gate, [B, T, Hq, 2D] */
		int64_t s4[4] = { B, T, hq, 2 * d };
		t[QG] = ej_linear_of(ctx, ej_module_child(attn, "q_proj"), x);
		t[QG4] = epj_reshape(ctx, t[QG], 4, s4);
		t[QH] = epj_slice(ctx, t[QG4], -1, 0, d, 1);
		t[GH] = epj_slice(ctx, t[QG4], -1, d, 2 * d, 1);
		t[QP] = epj_reshape(ctx, t[QH], 3, shp);
		t[GR] = epj_reshape(ctx, t[GH], 3, shp);
	} else {
		t[QP] = ej_linear_of(ctx, ej_module_child(attn, "q_proj"), x);
	}
	t[KP] = ej_linear_of(ctx, ej_module_child(attn, "k_proj"), x);
	t[VP] = ej_linear_of(ctx, ej_module_child(attn, "v_proj"), x);
	t[Q] = heads(ctx, t[QP], hq, d, ej_module_child(attn, "q_norm"), cfg);
	t[K] = heads(ctx, t[KP], hkv, d, ej_module_child(attn, "k_norm"), cfg);
	t[V] = heads(ctx, t[VP], hkv, d, NULL, cfg);
	t[QR] = rope_part(ctx, t[Q], cos, sin, rope_dim(cfg));
	t[KR] = rope_part(ctx, t[K], cos, sin, rope_dim(cfg));
	t[O] = epj_sdpa_docs(ctx, t[QR], t[KR], t[V], docs, true, 0.0);
	t[OT] = epj_transpose(ctx, t[O], 1, 2);
	t[OR] = epj_reshape(ctx, t[OT], 3, shp);
	if (cfg->attn_output_gate) {
		t[GS] = epj_sigmoid(ctx, t[GR]);
		t[OG] = epj_mul(ctx, t[OR], t[GS]);
	} else {
		t[OG] = epj_tensor_ref(t[OR]);
	}
	epj_tensor *y =
	    ej_linear_of(ctx, ej_module_child(attn, "o_proj"), t[OG]);
	ej_drop(t, N_T);
	return y;
}

/* The softmax scale of DeepSeek's attention: qk_head_dim^-1/2, times
 * YaRN's mscale(factor, mscale_all_dim)^2 under a scaled rope with
 * mscale_all_dim (transformers' yarn_apply_mscale). */
static double mla_scale(const ej_model_config *c)
{
	double sc =
	    1.0 / sqrt((double)(c->qk_nope_head_dim + c->qk_rope_head_dim));
	if (c->rope_type != EJ_ROPE_DEFAULT && c->rope_mscale_all_dim != 0 &&
	    c->rope_factor > 1) {
		double ms =
		    0.1 * c->rope_mscale_all_dim * log(c->rope_factor) + 1.0;
		sc *= ms * ms;
	}
	return sc;
}

/* DeepSeek's multi-head latent attention, x [B,T,H] -> o_proj output
 * (docs: the document ids, or NULL):
 *   q = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))  [B,Hn,T,dn+dr]
 *   ckv = kv_a_proj_with_mqa(x) = [kv (kv_lora_rank) | k_rot (dr)]
 *   kv = kv_b_proj(kv_a_layernorm(kv)) [B,Hn,T,dn+dv] = [k_nope | v]
 *   q = [q_nope | rope(q_rot)], k = [k_nope | rope(k_rot) on every head]
 *   o_proj(sdpa(q, k, v, causal, mla_scale))
 * Rope touches the dr rope dimensions only; cos/sin are [T, dr]. */
static epj_tensor *mla_attention(epj_ctx *ctx, epj_module *attn,
				 const ej_model_config *c, epj_tensor *x,
				 epj_tensor *cos, epj_tensor *sin,
				 epj_tensor *docs)
{
	enum {
		QA,
		QN,
		QP,
		Q4,
		QT,
		QPASS,
		QROT,
		QROTR,
		QC,
		CKV,
		KVN,
		KROT,
		KVNN,
		KR4,
		KRR,
		KRE,
		KVB,
		KV4,
		KVT,
		KNOPE,
		V,
		KC,
		O,
		OT,
		OR,
		N_T
	};
	epj_tensor *t[N_T] = { 0 };
	const int64_t B = x ? epj_tensor_dim(x, 0) : 0;
	const int64_t T = x ? epj_tensor_dim(x, 1) : 0;
	const int64_t Hn = c->num_attention_heads, dn = c->qk_nope_head_dim;
	const int64_t dr = c->qk_rope_head_dim, dv = c->v_head_dim;
	const int64_t dq = dn + dr, kvr = c->kv_lora_rank;
	const double eps = c->rms_norm_eps;
	epj_tensor *(*rot)(epj_ctx *, epj_tensor *, epj_tensor *,
			   epj_tensor *) =
	    c->rope_interleave ? rope_interleaved : rope;
	if (c->q_lora_rank) {
		t[QA] = ej_linear_of(ctx, ej_module_child(attn, "q_a_proj"), x);
		t[QN] = ej_rmsnorm(
		    ctx, t[QA],
		    ej_module_param(ej_module_child(attn, "q_a_layernorm"),
				    "weight"),
		    eps);
		t[QP] =
		    ej_linear_of(ctx, ej_module_child(attn, "q_b_proj"), t[QN]);
	} else {
		t[QP] = ej_linear_of(ctx, ej_module_child(attn, "q_proj"), x);
	}
	int64_t qs[4] = { B, T, Hn, dq };
	t[Q4] = epj_reshape(ctx, t[QP], 4, qs);
	t[QT] = t[Q4] ? epj_transpose(ctx, t[Q4], 1, 2) : NULL;
	t[QPASS] = epj_slice(ctx, t[QT], -1, 0, dn, 1);
	t[QROT] = epj_slice(ctx, t[QT], -1, dn, dq, 1);
	t[QROTR] = rot(ctx, t[QROT], cos, sin);
	epj_tensor *qparts[2] = { t[QPASS], t[QROTR] };
	t[QC] = (t[QPASS] && t[QROTR]) ? epj_cat(ctx, qparts, 2, -1) : NULL;

	t[CKV] =
	    ej_linear_of(ctx, ej_module_child(attn, "kv_a_proj_with_mqa"), x);
	t[KVN] = epj_slice(ctx, t[CKV], -1, 0, kvr, 1);
	t[KROT] = epj_slice(ctx, t[CKV], -1, kvr, kvr + dr, 1);
	t[KVNN] = ej_rmsnorm(
	    ctx, t[KVN],
	    ej_module_param(ej_module_child(attn, "kv_a_layernorm"), "weight"),
	    eps);
	int64_t ks[4] = { B, 1, T, dr };
	t[KR4] = epj_reshape(ctx, t[KROT], 4, ks);
	t[KRR] = rot(ctx, t[KR4], cos, sin);
	int64_t ke[4] = { B, Hn, T, dr };
	t[KRE] = epj_expand(ctx, t[KRR], 4, ke);
	t[KVB] = ej_linear_of(ctx, ej_module_child(attn, "kv_b_proj"), t[KVNN]);
	int64_t kvs[4] = { B, T, Hn, dn + dv };
	t[KV4] = epj_reshape(ctx, t[KVB], 4, kvs);
	t[KVT] = t[KV4] ? epj_transpose(ctx, t[KV4], 1, 2) : NULL;
	t[KNOPE] = epj_slice(ctx, t[KVT], -1, 0, dn, 1);
	t[V] = epj_slice(ctx, t[KVT], -1, dn, dn + dv, 1);
	epj_tensor *kparts[2] = { t[KNOPE], t[KRE] };
	t[KC] = (t[KNOPE] && t[KRE]) ? epj_cat(ctx, kparts, 2, -1) : NULL;

	t[O] = epj_sdpa_docs(ctx, t[QC], t[KC], t[V], docs, true, mla_scale(c));
	t[OT] = epj_transpose(ctx, t[O], 1, 2);
	int64_t os[3] = { B, T, Hn * dv };
	t[OR] = epj_reshape(ctx, t[OT], 3, os);
	epj_tensor *y =
	    ej_linear_of(ctx, ej_module_child(attn, "o_proj"), t[OR]);
	ej_drop(t, N_T);
	return y;
}

/* The shared expert's contribution for the MoE layer mlp on its input x:
 * DeepSeek's shared experts (one SwiGLU MLP, ungated) or Qwen2-MoE's
 * shared expert gated by sigmoid(x Wg^T); NULL with ctx's error on
 * failure.  The layer calls it (ej_autoep_set_shared) when its exchanges
 * run off the compute stream, else the block does. */
static epj_tensor *shared_expert(epj_ctx *ctx, epj_module *mlp, epj_tensor *x)
{
	epj_module *ses = ej_module_child(mlp, "shared_experts");
	if (ses)
		return swiglu(ctx, ses, x);
	epj_tensor *u[4] = { 0 };
	u[0] = swiglu(ctx, ej_module_child(mlp, "shared_expert"), x);
	u[1] = u[0] ? ej_linear_of(
			  ctx, ej_module_child(mlp, "shared_expert_gate"), x)
		    : NULL;
	u[2] = epj_sigmoid(ctx, u[1]);
	u[3] = epj_mul(ctx, u[2], u[0]);
	epj_tensor *y = u[3] ? epj_tensor_ref(u[3]) : NULL;
	ej_drop(u, 4);
	return y;
}

epj_tensor *ej_qwen3_block(epj_ctx *ctx, epj_module *blk, epj_tensor *h,
			   epj_tensor *cos, epj_tensor *sin, epj_tensor *docs)
{
	enum { X, A, H1, X2, M, N_T };
	epj_tensor *t[N_T] = { 0 };
	const ej_model_config *cfg = cfg_of(blk);
	t[X] = norm_of(ctx, cfg, h, ej_module_child(blk, "input_layernorm"));
	epj_module *la = ej_module_child(blk, "linear_attn");
	t[A] = la ? ej_deltanet_forward(ctx, la, cfg, t[X], docs)
		  : (cfg->mla ? mla_attention : attention)(
			ctx, ej_module_child(blk, "self_attn"), cfg, t[X], cos,
			sin, docs);
	t[H1] = epj_add(ctx, h, t[A]);
	t[X2] = norm_of(ctx, cfg, t[H1],
			ej_module_child(blk, "post_attention_layernorm"));
	epj_tensor *y = NULL;
	epj_module *mlp = ej_module_child(blk, names_of(cfg)->mlp);
	if (t[X2] && ej_module_call(ctx, mlp, &t[X2], 1, &t[M], 1) == EPJ_OK) {
		/* the shared expert (Qwen2-MoE's gated one, DeepSeek's):
		 * dense work, in the block (the compiled region), not in the
		 * MoE layer's graph break -- unless the layer's all-to-all
		 * runs off the compute stream: then the layer computes it
		 * while the dispatch travels and its output includes it */
		bool shared = ej_module_child(mlp, "shared_experts") ||
			      ej_module_child(mlp, "shared_expert");
		if (shared && !ej_autoep_shared_in_layer(mlp)) {
			epj_tensor *u = shared_expert(ctx, mlp, t[X2]);
			epj_tensor *sum = u ? epj_add(ctx, t[M], u) : NULL;
			epj_tensor_free(u);
			epj_tensor_free(t[M]);
			t[M] = sum;
		}
		y = t[M] ? epj_add(ctx, t[H1], t[M]) : NULL;
	}
	ej_drop(t, N_T);
	return y;
}

/* ---- module forwards
 * --------------------------------------------------------- */

/* decoder block: in = (h, cos, sin[, doc_ids]) -> (h) */
static epj_status block_forward(epj_ctx *ctx, epj_module *m,
				epj_tensor *const *in, int n_in,
				epj_tensor **out, int n_out)
{
	if ((n_in != 3 && n_in != 4) || n_out != 1)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: decoder block takes (h, cos, sin[, "
				"doc_ids])",
				m->name);
	out[0] = ej_qwen3_block(ctx, m, in[0], in[1], in[2],
				n_in > 3 ? in[3] : NULL);
	return out[0] ? EPJ_OK : ctx->status;
}

/* down(silu(gate(x)) * up(x)) of a SwiGLU MLP module m */
static epj_tensor *swiglu(epj_ctx *ctx, epj_module *m, epj_tensor *x)
{
	epj_tensor *t[4] = { 0 };
	t[0] = ej_linear_of(ctx, ej_module_child(m, "gate_proj"), x);
	t[1] = epj_silu(ctx, t[0]);
	t[2] = ej_linear_of(ctx, ej_module_child(m, "up_proj"), x);
	t[3] = epj_mul(ctx, t[1], t[2]);
	epj_tensor *y =
	    ej_linear_of(ctx, ej_module_child(m, "down_proj"), t[3]);
	ej_drop(t, 4);
	return y;
}

/* dense SwiGLU MLP: in = (x) -> down(silu(gate(x)) * up(x)) */
static epj_status mlp_forward(epj_ctx *ctx, epj_module *m,
			      epj_tensor *const *in, int n_in, epj_tensor **out,
			      int n_out)
{
	(void)n_in;
	(void)n_out;
	out[0] = swiglu(ctx, m, in[0]);
	return out[0] ? EPJ_OK : ctx->status;
}

/* YaRN's get_mscale. */
static double yarn_mscale(double scale, double mscale)
{
	return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* The factor on cos and sin (transformers' attention_scaling): 1, or
 * YaRN's attention_factor (given, else mscale(factor, mscale) /
 * mscale(factor, mscale_all_dim) when both are given and non-zero, else
 * mscale(factor)). */
static float rope_attention_factor(const ej_model_config *c)
{
	if (c->rope_type != EJ_ROPE_YARN)
		return 1.0f;
	if (c->rope_attention_factor > 0)
		return (float)c->rope_attention_factor;
	if (c->rope_mscale != 0 && c->rope_mscale_all_dim != 0)
		return (
		    float)(yarn_mscale(c->rope_factor, c->rope_mscale) /
			   yarn_mscale(c->rope_factor, c->rope_mscale_all_dim));
	return (float)yarn_mscale(c->rope_factor, 1.0);
}

/* YaRN's correction dimension of num_rot rotations. */
static double yarn_dim(double num_rot, int64_t d, double base, double omax)
{
	return ((double)d *
		log(omax / (num_rot * 2 * 3.14159265358979323846))) /
	       (2 * log(base));
}

/* inv_freq[i] of the pair i of d rope dimensions, in f32 as transformers'
 * rope init functions compute it: base^-(2i/d); linear: divided by factor;
 * yarn: the interpolated 1/(factor base^(2i/d)) and the extrapolated
 * base^-(2i/d) blended by a ramp over the correction range of beta_fast,
 * beta_slow rotations at original_max_position_embeddings. */
static float rope_inv_freq(const ej_model_config *c, int64_t i, int64_t d)
{
	double e = (double)(2 * i) / (double)d;
	float inv = (float)(1.0 / pow(c->rope_theta, e));
	if (c->rope_type == EJ_ROPE_LINEAR)
		return inv / (float)c->rope_factor;
	if (c->rope_type != EJ_ROPE_YARN)
		return inv;
	double omax = c->rope_original_max ? (double)c->rope_original_max
					   : (double)c->max_position_embeddings;
	double lo = yarn_dim(c->rope_beta_fast, d, c->rope_theta, omax);
	double hi = yarn_dim(c->rope_beta_slow, d, c->rope_theta, omax);
	if (c->rope_truncate) {
		lo = floor(lo);
		hi = ceil(hi);
	}
	lo = lo > 0 ? lo : 0;
	hi = hi < (double)(d - 1) ? hi : (double)(d - 1);
	if (lo == hi)
		hi += 0.001; /* as transformers: no singularity */
	float ramp = ((float)i - (float)lo) / (float)(hi - lo);
	ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
	float extra = 1.0f - ramp;
	float interp =
	    1.0f / ((float)c->rope_factor * (float)pow(c->rope_theta, e));
	return interp * (1.0f - extra) + inv * extra;
}

/* cos/sin [T, D] for positions 0..T-1 in dtype dt (HF: f32, cast to x). */
static epj_status rope_tables(epj_ctx *ctx, const ej_model_config *cfg,
			      int64_t T, epj_dtype dt, epj_tensor **cos,
			      epj_tensor **sin)
{
	int64_t d = rope_dim(cfg), shp[2] = { T, d };
	double *c = malloc(sizeof *c * (size_t)(T * d));
	double *s = malloc(sizeof *s * (size_t)(T * d));
	*cos = *sin = NULL;
	if (!c || !s) {
		free(c);
		free(s);
		return ej_error(ctx, EPJ_ERR_NOMEM, "rope: out of memory");
	}
	const float af = rope_attention_factor(cfg);
	for (int64_t p = 0; p < T; p++) {
		for (int64_t i = 0; i < d / 2; i++) {
			/* HF computes inv_freq and the angle in f32, and
			 * scales cos and sin by the attention factor */
			float ang = (float)p * rope_inv_freq(cfg, i, d);
			c[p * d + i] = c[p * d + i + d / 2] = cosf(ang) * af;
			s[p * d + i] = s[p * d + i + d / 2] = sinf(ang) * af;
		}
	}
	/* Real tables even while the forward is traced (full-model compile,
	 * root layout): recording paused, they are captured as constants. */
	const void *rec = ej_trace_pause(ctx);
	bool prev = epj_no_grad_enter(ctx);
	*cos = epj_zeros(ctx, dt, 2, shp);
	*sin = epj_zeros(ctx, dt, 2, shp);
	epj_no_grad_exit(ctx, prev);
	epj_status st = (*cos && *sin) ? EPJ_OK : ctx->status;
	if (st == EPJ_OK)
		st = epj_tensor_from_f64(ctx, *cos, c);
	if (st == EPJ_OK)
		st = epj_tensor_from_f64(ctx, *sin, s);
	ej_trace_resume(ctx, rec);
	free(c);
	free(s);
	if (st != EPJ_OK) {
		epj_tensor_free(*cos);
		epj_tensor_free(*sin);
		*cos = *sin = NULL;
	}
	return st;
}

/* The model whose config is cfg (both layouts' root modules point at the
 * model's own config). */
static epj_model *model_of(const ej_model_config *cfg)
{
	return (epj_model *)(void *)((char *)cfg - offsetof(epj_model, cfg));
}

/* The rope tables for T positions in dtype dt: new references to the
 * model's, built at the first forward of that (T, dt) and kept on the model
 * (the context is the model's).  While tracing, or in shape-only mode,
 * fresh tables every call, as before. */
static epj_status rope_tables_cached(epj_ctx *ctx, const ej_model_config *cfg,
				     int64_t T, epj_dtype dt, epj_tensor **cos,
				     epj_tensor **sin)
{
	epj_model *mo = model_of(cfg);
	if (ctx->recorder || ctx->meta)
		return rope_tables(ctx, cfg, T, dt, cos, sin);
	epj_tensor *c = mo->rope_cos, *s = mo->rope_sin;
	if (!c || c->ctx != ctx || epj_tensor_dtype(c) != dt ||
	    epj_tensor_dim(c, 0) != T) {
		epj_status st = rope_tables(ctx, cfg, T, dt, &c, &s);
		if (st != EPJ_OK)
			return st;
		epj_tensor_free(mo->rope_cos);
		epj_tensor_free(mo->rope_sin);
		mo->rope_cos = c;
		mo->rope_sin = s;
	}
	*cos = epj_tensor_ref(c);
	*sin = epj_tensor_ref(s);
	return EPJ_OK;
}

/* The rope tables of a forward over T positions: the cached [T, D] ones,
 * or with position ids pos [B, T] (each in [0, T)) their rows, [B, 1, T,
 * D]: an embedding lookup, so the positions are data of a compiled graph
 * and the tables stay its constants. */
static epj_status rope_for(epj_ctx *ctx, const ej_model_config *cfg, int64_t T,
			   epj_tensor *pos, epj_dtype dt, epj_tensor **cos,
			   epj_tensor **sin)
{
	epj_tensor *c = NULL, *s = NULL;
	epj_status st = rope_tables_cached(ctx, cfg, T, dt, &c, &s);
	if (st != EPJ_OK || !pos) {
		*cos = c;
		*sin = s;
		return st;
	}
	int64_t shp[4] = { epj_tensor_dim(pos, 0), 1, T, rope_dim(cfg) };
	epj_tensor *t[2] = { epj_embedding(ctx, c, pos),
			     epj_embedding(ctx, s, pos) };
	*cos = t[0] ? epj_reshape(ctx, t[0], 4, shp) : NULL;
	*sin = t[1] ? epj_reshape(ctx, t[1], 4, shp) : NULL;
	ej_drop(t, 2);
	epj_tensor_free(c);
	epj_tensor_free(s);
	if (*cos && *sin)
		return EPJ_OK;
	epj_tensor_free(*cos);
	epj_tensor_free(*sin);
	*cos = *sin = NULL;
	return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
}

/* logits (and loss) from the final hidden states */
static epj_status head(epj_ctx *ctx, epj_module *norm, epj_module *lm_head,
		       const ej_model_config *cfg, epj_tensor *h,
		       epj_tensor *labels, epj_tensor **out, int n_out)
{
	epj_tensor *t[3] = { 0 };
	t[0] = norm_of(ctx, cfg, h, norm);
	out[0] = ej_linear_of(ctx, lm_head, t[0]);
	if (n_out > 1 && labels && out[0]) {
		int64_t n =
		    epj_tensor_dim(out[0], 0) * epj_tensor_dim(out[0], 1);
		int64_t s2[2] = { n, cfg->vocab_size };
		t[1] = epj_reshape(ctx, out[0], 2, s2);
		t[2] = epj_reshape(ctx, labels, 1, &n);
		out[1] = epj_cross_entropy(ctx, t[1], t[2], -100);
	}
	ej_drop(t, 3);
	if (!out[0] || (n_out > 1 && labels && !out[1]))
		return ctx->status;
	return EPJ_OK;
}

static epj_status check_ids(epj_ctx *ctx, const epj_module *m, epj_tensor *ids,
			    epj_tensor *labels, const ej_model_config *cfg)
{
	if (epj_tensor_ndim(ids) != 2)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s: input_ids must be [B, T], got %d dims",
				m->kind, epj_tensor_ndim(ids));
	if (epj_tensor_dim(ids, 1) > cfg->max_position_embeddings)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s: sequence length %lld exceeds "
				"max_position_embeddings %lld",
				m->kind, (long long)epj_tensor_dim(ids, 1),
				(long long)cfg->max_position_embeddings);
	if (cfg->sliding_window > 0 &&
	    epj_tensor_dim(ids, 1) > cfg->sliding_window)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: sequence length %lld exceeds "
				"sliding_window %lld: sliding-window "
				"attention is not implemented (use a "
				"sequence of at most sliding_window tokens, "
				"or --model-override sliding_window=null "
				"for full causal attention)",
				m->kind, (long long)epj_tensor_dim(ids, 1),
				(long long)cfg->sliding_window);
	if (labels && (epj_tensor_ndim(labels) != 2 ||
		       epj_tensor_dim(labels, 0) != epj_tensor_dim(ids, 0) ||
		       epj_tensor_dim(labels, 1) != epj_tensor_dim(ids, 1)))
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s: labels must have the shape of input_ids",
				m->kind);
	return EPJ_OK;
}

/* The root's inputs (input_ids[, labels[, position_ids][, doc_ids]]): the
 * optional ones as the model's docs_pos and docs_attn say, each [B, T]. */
typedef struct root_in {
	epj_tensor *ids, *labels, *pos, *docs;
} root_in;

static epj_status root_inputs(epj_ctx *ctx, const epj_module *m,
			      epj_tensor *const *in, int n_in, root_in *r)
{
	const ej_model_config *cfg = m->impl;
	const epj_model *mo = model_of(cfg);
	memset(r, 0, sizeof *r);
	r->ids = in[0];
	r->labels = n_in > 1 ? in[1] : NULL;
	int k = 2;
	if (n_in > 1 && mo->docs_pos)
		r->pos = k < n_in ? in[k++] : NULL;
	if (n_in > 1 && mo->docs_attn)
		r->docs = k < n_in ? in[k++] : NULL;
	if (n_in > 1 && (n_in != k || (mo->docs_pos && !r->pos) ||
			 (mo->docs_attn && !r->docs)))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: forward takes (input_ids, labels%s%s), "
				"got %d inputs",
				m->kind, mo->docs_pos ? ", position_ids" : "",
				mo->docs_attn ? ", doc_ids" : "", n_in);
	epj_status st = check_ids(ctx, m, r->ids, r->labels, cfg);
	epj_tensor *extra[2] = { r->pos, r->docs };
	for (int i = 0; st == EPJ_OK && i < 2; i++)
		if (extra[i] &&
		    (epj_tensor_ndim(extra[i]) != 2 ||
		     epj_tensor_dim(extra[i], 0) != epj_tensor_dim(r->ids, 0) ||
		     epj_tensor_dim(extra[i], 1) != epj_tensor_dim(r->ids, 1)))
			st = ej_error(ctx, EPJ_ERR_SHAPE,
				      "%s: %s must have the shape of input_ids",
				      m->kind, i ? "doc_ids" : "position_ids");
	return st;
}

/* nested root: in = (input_ids[, labels[, position_ids][, doc_ids]]) ->
 * (logits[, loss]) */
static epj_status causal_lm_forward(epj_ctx *ctx, epj_module *m,
				    epj_tensor *const *in, int n_in,
				    epj_tensor **out, int n_out)
{
	const ej_model_config *cfg = m->impl;
	root_in r;
	epj_status st = root_inputs(ctx, m, in, n_in, &r);
	if (st != EPJ_OK)
		return st;
	epj_tensor *labels = r.labels;
	epj_module *model = ej_module_child(m, "model");
	epj_module *layers = ej_module_child(model, "layers");
	epj_tensor *h = epj_embedding(
	    ctx,
	    ej_module_param(ej_module_child(model, "embed_tokens"), "weight"),
	    in[0]);
	if (!h)
		return ctx->status;
	epj_tensor *cos = NULL, *sin = NULL;
	st = rope_for(ctx, cfg, epj_tensor_dim(in[0], 1), r.pos,
		      epj_tensor_dtype(h), &cos, &sin);
	for (int i = 0; st == EPJ_OK && i < layers->n_children; i++) {
		epj_tensor *args[4] = { h, cos, sin, r.docs }, *nh = NULL;
		st = ej_module_call(ctx, layers->children[i], args,
				    r.docs ? 4 : 3, &nh, 1);
		epj_tensor_free(h);
		h = nh;
	}
	if (st == EPJ_OK)
		st = head(ctx, ej_module_child(model, "norm"),
			  ej_module_child(m, "lm_head"), cfg, h, labels, out,
			  n_out);
	epj_tensor_free(h);
	epj_tensor_free(cos);
	epj_tensor_free(sin);
	return st;
}

/* root layout: everything in the root's own forward, mlp is a child */
static epj_status root_forward(epj_ctx *ctx, epj_module *m,
			       epj_tensor *const *in, int n_in,
			       epj_tensor **out, int n_out)
{
	const ej_model_config *cfg = m->impl;
	root_in r;
	epj_status st = root_inputs(ctx, m, in, n_in, &r);
	if (st != EPJ_OK)
		return st;
	epj_tensor *labels = r.labels;
	epj_tensor *h = epj_embedding(
	    ctx, ej_module_param(ej_module_child(m, "embed_tokens"), "weight"),
	    in[0]);
	if (!h)
		return ctx->status;
	epj_tensor *cos = NULL, *sin = NULL, *h2 = NULL;
	st = rope_for(ctx, cfg, epj_tensor_dim(in[0], 1), r.pos,
		      epj_tensor_dtype(h), &cos, &sin);
	if (st == EPJ_OK) {
		h2 = ej_qwen3_block(ctx, m, h, cos, sin, r.docs);
		if (!h2)
			st = ctx->status;
	}
	if (st == EPJ_OK)
		st = head(ctx, ej_module_child(m, "norm"),
			  ej_module_child(m, "lm_head"), cfg, h2, labels, out,
			  n_out);
	epj_tensor_free(h);
	epj_tensor_free(h2);
	epj_tensor_free(cos);
	epj_tensor_free(sin);
	return st;
}

/* ---- construction
 * -------------------------------------------------------------- */

epj_status ej_add_linear(epj_ctx *ctx, epj_module *parent, const char *local,
			 int64_t out_f, int64_t in_f, double std)
{
	epj_module *l = ej_module_new(parent, local, "Linear", NULL);
	int64_t shp[2] = { out_f, in_f };
	if (!l)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	if (!ej_module_add_param(
		l, "weight", epj_randn(ctx, EPJ_DTYPE_F32, 2, shp, 0.0, std)))
		return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	return EPJ_OK;
}

/* A Linear with a bias [out_f], initialised to zeros as HF's
 * _init_weights does. */
static epj_status add_linear_bias(epj_ctx *ctx, epj_module *parent,
				  const char *local, int64_t out_f,
				  int64_t in_f, double std)
{
	epj_status st = ej_add_linear(ctx, parent, local, out_f, in_f, std);
	if (st != EPJ_OK)
		return st;
	epj_module *l = ej_module_child(parent, local);
	if (!ej_module_add_param(l, "bias",
				 epj_zeros(ctx, EPJ_DTYPE_F32, 1, &out_f)))
		return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	return EPJ_OK;
}

static epj_status add_norm(epj_ctx *ctx, const ej_model_config *c,
			   epj_module *parent, const char *local, int64_t n)
{
	epj_module *l = ej_module_new(parent, local, names_of(c)->norm, NULL);
	if (!l)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	/* ones; a zero-centred norm's zeros (its scale is 1 + w) */
	if (!ej_module_add_param(l, "weight",
				 epj_full(ctx, EPJ_DTYPE_F32, 1, &n,
					  c->norm_offset ? 0.0 : 1.0)))
		return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	return EPJ_OK;
}

/* A SwiGLU MLP parent.local (gate_proj, up_proj [I, H], down_proj [H, I]). */
static epj_status add_swiglu(epj_ctx *ctx, epj_module *parent,
			     const char *local, const family_names *fn,
			     int64_t I, int64_t H, double std)
{
	epj_module *mlp =
	    ej_module_new(parent, local, fn->dense_kind, mlp_forward);
	if (!mlp)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	epj_status st = ej_add_linear(ctx, mlp, "gate_proj", I, H, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, mlp, "up_proj", I, H, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, mlp, "down_proj", H, I, std);
	return st;
}

/* DeepSeek's latent attention under attn, in transformers' order. */
static epj_status build_mla(epj_ctx *ctx, const ej_model_config *c,
			    epj_module *attn)
{
	const double std = c->initializer_range;
	const int64_t H = c->hidden_size, Hn = c->num_attention_heads;
	const int64_t dq = c->qk_nope_head_dim + c->qk_rope_head_dim;
	epj_status st;
	if (c->q_lora_rank) {
		st = ej_add_linear(ctx, attn, "q_a_proj", c->q_lora_rank, H,
				   std);
		if (st == EPJ_OK)
			st = add_norm(ctx, c, attn, "q_a_layernorm",
				      c->q_lora_rank);
		if (st == EPJ_OK)
			st = ej_add_linear(ctx, attn, "q_b_proj", Hn * dq,
					   c->q_lora_rank, std);
	} else {
		st = ej_add_linear(ctx, attn, "q_proj", Hn * dq, H, std);
	}
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, attn, "kv_a_proj_with_mqa",
				   c->kv_lora_rank + c->qk_rope_head_dim, H,
				   std);
	if (st == EPJ_OK)
		st = add_norm(ctx, c, attn, "kv_a_layernorm", c->kv_lora_rank);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, attn, "kv_b_proj",
				   Hn * (c->qk_nope_head_dim + c->v_head_dim),
				   c->kv_lora_rank, std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, attn, "o_proj", H, Hn * c->v_head_dim,
				   std);
	return st;
}

/* Block contents (attention, norms, mlp) under `blk`. */
static epj_status build_block(epj_ctx *ctx, epj_model *model, epj_module *blk,
			      int layer, const epj_model_opts *opts)
{
	const ej_model_config *c = &model->cfg;
	double std = c->initializer_range;
	int64_t H = c->hidden_size, D = c->head_dim;
	const family_names *fn = names_of(c);
	epj_status (*qkv)(epj_ctx *, epj_module *, const char *, int64_t,
			  int64_t, double) =
	    c->qkv_bias ? add_linear_bias : ej_add_linear;
	epj_status st = add_norm(ctx, c, blk, "input_layernorm", H);
	/* Qwen3.5's linear-attention layers: Gated DeltaNet instead */
	bool lin = c->linear_layer[layer];
	if (st == EPJ_OK && lin)
		st = ej_deltanet_build(ctx, c, blk, "Qwen3_5MoeRMSNormGated");
	epj_module *attn =
	    st || lin ? NULL : ej_module_new(blk, "self_attn", fn->attn, NULL);
	if (lin)
		goto norms;
	if (st == EPJ_OK && !attn)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	if (st == EPJ_OK && c->mla) {
		st = build_mla(ctx, c, attn);
		goto norms;
	}
	if (st == EPJ_OK && c->attn_output_gate) /* query and gate */
		st = qkv(ctx, attn, "q_proj", 2 * c->num_attention_heads * D, H,
			 std);
	if (st == EPJ_OK && c->attn_output_gate)
		goto kv;
	if (st == EPJ_OK)
		st = qkv(ctx, attn, "q_proj", c->num_attention_heads * D, H,
			 std);
kv:
	if (st == EPJ_OK)
		st = qkv(ctx, attn, "k_proj", c->num_key_value_heads * D, H,
			 std);
	if (st == EPJ_OK)
		st = qkv(ctx, attn, "v_proj", c->num_key_value_heads * D, H,
			 std);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, attn, "o_proj", H,
				   c->num_attention_heads * D, std);
	if (st == EPJ_OK && c->qk_norm)
		st = add_norm(ctx, c, attn, "q_norm", D);
	if (st == EPJ_OK && c->qk_norm)
		st = add_norm(ctx, c, attn, "k_norm", D);
norms:
	if (st == EPJ_OK)
		st = add_norm(ctx, c, blk, "post_attention_layernorm", H);
	if (st != EPJ_OK)
		return st;
	if (ej_model_layer_is_moe(c, layer)) {
		ej_autoep_opts eo = {
			.num_experts = c->num_experts,
			.top_k = c->num_experts_per_tok,
			.norm_topk_prob = c->norm_topk_prob,
			.fixed_routing = opts->fixed_routing,
			.scoring = c->scoring,
			.groups = c->groups,
			.n_group = c->n_group,
			.topk_group = c->topk_group,
			.routed_scaling_factor = c->routed_scaling_factor,
			.score_bias = c->score_bias,
			.expert_kind = fn->expert_kind,
			.proj = { fn->proj[0], fn->proj[1], fn->proj[2] }
		};
		epj_module *moe = ej_autoep_new(
		    ctx, blk, fn->mlp, (int)H, (int)c->moe_intermediate_size,
		    &eo, EPJ_DTYPE_F32, std, model->comm);
		if (!moe)
			return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
		if (c->shared_expert_intermediate_size > 0) {
			/* Qwen2-MoE: mlp.shared_expert (a SwiGLU MLP) and
			 * mlp.shared_expert_gate [1, H], after the gate and
			 * the experts as in HF's module order */
			int64_t S = c->shared_expert_intermediate_size;
			epj_module *se = ej_module_new(
			    moe, "shared_expert", fn->dense_kind, mlp_forward);
			if (!se)
				return ej_error(ctx, EPJ_ERR_NOMEM,
						"out of memory");
			st = ej_add_linear(ctx, se, "gate_proj", S, H, std);
			if (st == EPJ_OK)
				st = ej_add_linear(ctx, se, "up_proj", S, H,
						   std);
			if (st == EPJ_OK)
				st = ej_add_linear(ctx, se, "down_proj", H, S,
						   std);
			if (st == EPJ_OK)
				st = ej_add_linear(
				    ctx, moe, "shared_expert_gate", 1, H, std);
			if (st != EPJ_OK)
				return st;
			/* the decoder block computes them (its region) */
			se->region_owned = true;
			ej_module_child(moe, "shared_expert_gate")
			    ->region_owned = true;
			ej_autoep_set_shared(moe, shared_expert);
		}
		if (c->n_shared_experts > 0) {
			/* DeepSeek: mlp.shared_experts, a SwiGLU MLP of
			 * n_shared_experts x moe_intermediate_size, dense
			 * work of the block's region */
			st = add_swiglu(ctx, moe, "shared_experts", fn,
					c->moe_intermediate_size *
					    c->n_shared_experts,
					H, std);
			if (st != EPJ_OK)
				return st;
			ej_module_child(moe, "shared_experts")->region_owned =
			    true;
			ej_autoep_set_shared(moe, shared_expert);
		}
		epj_module **nm = realloc(
		    model->moe, sizeof *nm * (size_t)(model->n_moe + 1));
		if (!nm)
			return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		model->moe = nm;
		model->moe[model->n_moe++] = moe;
		return EPJ_OK;
	}
	return add_swiglu(ctx, blk, fn->mlp, fn, c->intermediate_size, H, std);
}

static void noop_free(void *p)
{
	(void)p;
}

static epj_status build(epj_ctx *ctx, epj_model *model,
			const epj_model_opts *opts)
{
	const ej_model_config *c = &model->cfg;
	const family_names *fn = names_of(c);
	double std = c->initializer_range;
	epj_status st;
	if (model->layout == EPJ_LAYOUT_ROOT) {
		epj_module *r =
		    ej_module_new(NULL, "", fn->root_lm, root_forward);
		if (!r)
			return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		model->root = r;
		r->impl = &model->cfg;
		r->impl_free = noop_free;
		int64_t es[2] = { c->vocab_size, c->hidden_size };
		epj_module *emb =
		    ej_module_new(r, "embed_tokens", "Embedding", NULL);
		if (!emb || !ej_module_add_param(
				emb, "weight",
				epj_randn(ctx, EPJ_DTYPE_F32, 2, es, 0.0, std)))
			return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
		st = build_block(ctx, model, r, 0, opts);
		if (st == EPJ_OK)
			st = add_norm(ctx, c, r, "norm", c->hidden_size);
		if (st == EPJ_OK)
			st = ej_add_linear(ctx, r, "lm_head", c->vocab_size,
					   c->hidden_size, std);
		return st;
	}
	epj_module *r = ej_module_new(NULL, "", fn->lm, causal_lm_forward);
	if (!r)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	model->root = r;
	r->impl = &model->cfg;
	r->impl_free = noop_free;
	epj_module *mm = ej_module_new(r, "model", fn->model, NULL);
	if (!mm)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	int64_t es[2] = { c->vocab_size, c->hidden_size };
	epj_module *emb = ej_module_new(mm, "embed_tokens", "Embedding", NULL);
	if (!emb ||
	    !ej_module_add_param(
		emb, "weight", epj_randn(ctx, EPJ_DTYPE_F32, 2, es, 0.0, std)))
		return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
	epj_module *layers = ej_module_new(mm, "layers", "ModuleList", NULL);
	if (!layers)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; i < c->num_hidden_layers; i++) {
		char nm[16];
		snprintf(nm, sizeof nm, "%d", i);
		epj_module *blk =
		    ej_module_new(layers, nm, fn->layer, block_forward);
		if (!blk)
			return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		st = build_block(ctx, model, blk, i, opts);
		if (st != EPJ_OK)
			return st;
	}
	st = add_norm(ctx, c, mm, "norm", c->hidden_size);
	if (st == EPJ_OK)
		st = ej_add_linear(ctx, r, "lm_head", c->vocab_size,
				   c->hidden_size, std);
	return st;
}

/* The router losses of the MoE layers (runtime/router_loss.c), with
 * transformers' auxiliary loss when config.json asks for it: for the
 * families whose modeling code in transformers adds one (not
 * DeepSeek-V2/V3, where output_router_logits only returns the logits). */
static epj_status router_losses(epj_ctx *ctx, epj_model *m)
{
	const ej_model_config *c = &m->cfg;
	if (m->n_moe == 0)
		return EPJ_OK;
	bool ds = c->family == EJ_FAMILY_DEEPSEEK_V2 ||
		  c->family == EJ_FAMILY_DEEPSEEK_V3;
	if (ds && c->output_router_logits)
		epj_log_msg(EPJ_LOG_WARN,
			    "config: output_router_logits is true: "
			    "transformers' DeepSeek-V2/V3 add no auxiliary "
			    "loss for it, and neither does epjit (the moe "
			    "section of the training config has Megatron's "
			    "router losses)");
	m->rloss = ej_rloss_new(
	    m->n_moe, c->num_experts, c->num_experts_per_tok, c->scoring,
	    c->output_router_logits && !ds, c->router_aux_loss_coef);
	if (!m->rloss)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; i < m->n_moe; i++)
		EJ_ASSERT(ej_autoep_set_rloss(m->moe[i], m->rloss, i) ==
			  EPJ_OK);
	return EPJ_OK;
}

epj_status epj_model_new(epj_ctx *ctx, const char *config_path,
			 const epj_model_opts *opts, epj_model **out)
{
	epj_model_opts def = { .layout = EPJ_LAYOUT_NESTED,
			       .seed = 42,
			       .dtype = EPJ_DTYPE_F32 };
	*out = NULL;
	if (!opts)
		opts = &def;
	epj_model *m = calloc(1, sizeof *m);
	if (!m)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	epj_status st = EPJ_OK;
	if (config_path)
		st = ej_model_config_load_overrides(
		    ctx, config_path, opts->config_overrides,
		    opts->n_config_overrides, &m->cfg);
	else if (opts->n_config_overrides > 0)
		st = ej_error(ctx, EPJ_ERR_INVALID,
			      "model config overrides (\"%s\" ...) need a "
			      "config.json: the built-in tiny model has none",
			      opts->config_overrides[0]);
	else
		ej_model_config_tiny(&m->cfg);
	if (st != EPJ_OK) {
		free(m);
		return st;
	}
	if (m->cfg.tie_word_embeddings) {
		free(m);
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"config: tie_word_embeddings=true is not "
				"supported (separate lm_head expected)");
	}
	m->layout = opts->layout;
	if (m->layout == EPJ_LAYOUT_ROOT && m->cfg.num_hidden_layers != 1) {
		epj_log_msg(EPJ_LOG_INFO,
			    "root layout: num_hidden_layers=%d taken as 1 (the "
			    "root module holds a single block)",
			    m->cfg.num_hidden_layers);
		m->cfg.num_hidden_layers = 1;
	}
	m->comm = ej_comm_self_new();
	if (!m->comm) {
		free(m);
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	}
	/* Initialisation draws from a dedicated seed so that it is identical
	 * across runs whatever the context has drawn before. */
	ej_rng saved = ctx->rng;
	epj_ctx_seed(ctx, opts->seed);
	st = build(ctx, m, opts);
	ctx->rng = saved;
	if (st == EPJ_OK)
		st = ej_module_params(ctx, m->root, &m->params);
	if (st == EPJ_OK)
		st = router_losses(ctx, m);
	bool prev = epj_no_grad_enter(ctx);
	for (int i = 0;
	     st == EPJ_OK && opts->dtype != EPJ_DTYPE_F32 && i < m->params.n;
	     i++) {
		epj_tensor *c = epj_cast(ctx, m->params.params[i], opts->dtype);
		st = c ? epj_model_set_param(ctx, m, i, c) : ctx->status;
		epj_tensor_free(c);
	}
	epj_no_grad_exit(ctx, prev);
	if (st != EPJ_OK) {
		epj_model_free(m);
		return st;
	}
	*out = m;
	return EPJ_OK;
}

void epj_model_free(epj_model *m)
{
	if (!m)
		return;
	ej_param_list_free(&m->params);
	ej_module_free(m->root);
	ej_comm_free(m->comm);
	if (m->has_groups)
		ej_groups_free(&m->groups);
	free(m->moe);
	ej_rloss_free(m->rloss);
	epj_tensor_free(m->rope_cos);
	epj_tensor_free(m->rope_sin);
	free(m);
}

epj_module *epj_model_root(epj_model *m)
{
	return m->root;
}

epj_status epj_model_forward(epj_ctx *ctx, epj_model *m, epj_tensor *input_ids,
			     epj_tensor *labels, epj_tensor **logits,
			     epj_tensor **loss)
{
	return epj_model_forward_docs(ctx, m, input_ids, labels, NULL, NULL,
				      logits, loss);
}

epj_status epj_model_forward_docs(epj_ctx *ctx, epj_model *m,
				  epj_tensor *input_ids, epj_tensor *labels,
				  epj_tensor *position_ids, epj_tensor *doc_ids,
				  epj_tensor **logits, epj_tensor **loss)
{
	epj_tensor *in[4] = { input_ids, labels }, *out[2] = { 0 };
	/* whatever ran since the last forward may have written parameters
	 * (an optimizer, a load): their f32 views are stale (lib/wcache.c) */
	ej_params_written(ctx);
	if (logits)
		*logits = NULL;
	if (loss)
		*loss = NULL;
	if (!input_ids)
		return ctx->status ? ctx->status
				   : ej_error(ctx, EPJ_ERR_INVALID,
					      "model forward: input_ids is "
					      "NULL");
	if ((position_ids || doc_ids) && !labels)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"model forward: position_ids and doc_ids need "
				"labels");
	/* the root's inputs follow what is given (a compiled region's
	 * guards see the count) */
	m->docs_pos = position_ids != NULL;
	m->docs_attn = doc_ids != NULL;
	const int nout = labels ? 2 : 1;
	int n = nout;
	if (position_ids)
		in[n++] = position_ids;
	if (doc_ids)
		in[n++] = doc_ids;
	/* the router losses of this forward (runtime/router_loss.c): counted
	 * by the MoE layers, added to the loss, as transformers adds its
	 * auxiliary loss when labels are given */
	ej_rloss_begin(m->rloss, epj_grad_enabled(ctx));
	double add = 0;
	epj_status st = ej_module_call(ctx, m->root, in, n, out, nout);
	if (st == EPJ_OK)
		st = ej_rloss_end(ctx, m->rloss, &add);
	if (st == EPJ_OK && out[1] && ej_rloss_on(m->rloss))
		st = ej_rloss_add_to_loss(ctx, m->rloss, add, &out[1]);
	if (st != EPJ_OK) {
		epj_tensor_free(out[0]);
		epj_tensor_free(out[1]);
		return st;
	}
	if (logits)
		*logits = out[0];
	else
		epj_tensor_free(out[0]);
	if (loss)
		*loss = out[1];
	else
		epj_tensor_free(out[1]);
	return EPJ_OK;
}

int epj_model_num_params(const epj_model *m)
{
	return m->params.n;
}

const char *epj_model_param_name(const epj_model *m, int i)
{
	return i >= 0 && i < m->params.n ? m->params.names[i] : NULL;
}

epj_tensor *epj_model_param(const epj_model *m, int i)
{
	return i >= 0 && i < m->params.n ? m->params.params[i] : NULL;
}

epj_status epj_model_set_param(epj_ctx *ctx, epj_model *m, int i, epj_tensor *t)
{
	if (i < 0 || i >= m->params.n || !t)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"set_param: bad index %d or NULL tensor", i);
	epj_tensor *old = m->params.params[i];
	bool same = epj_tensor_ndim(old) == epj_tensor_ndim(t);
	for (int d = 0; same && d < epj_tensor_ndim(t); d++)
		same = epj_tensor_dim(old, d) == epj_tensor_dim(t, d);
	if (!same) {
		char a[64], b[64];
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"set_param %s: shape %s does not match %s",
				m->params.names[i],
				epj_tensor_describe(t, a, sizeof a),
				epj_tensor_describe(old, b, sizeof b));
	}
	epj_module *owner = m->params.owners[i];
	for (int k = 0; k < owner->n_params; k++) {
		if (owner->params[k] != old)
			continue;
		epj_tensor *nt = epj_detach(ctx, t);
		if (!nt)
			return ctx->status;
		/* a buffer (DeepSeek-V3's e_score_correction_bias) stays
		 * one: state that no gradient reaches */
		epj_tensor_set_requires_grad(nt, epj_tensor_requires_grad(old));
		ej_storage_mark_param(nt);
		ej_params_written(ctx);
		owner->params[k] = nt;
		m->params.params[i] = nt;
		epj_tensor_free(old);
		return EPJ_OK;
	}
	EJ_ASSERT(!"parameter list out of sync with its owner");
	return EPJ_ERR_STATE;
}

int64_t epj_model_num_elements(const epj_model *m)
{
	int64_t n = 0;
	for (int i = 0; i < m->params.n; i++)
		n += epj_tensor_numel(m->params.params[i]);
	return n;
}

int epj_model_vocab_size(const epj_model *m)
{
	return (int)m->cfg.vocab_size;
}

void epj_model_set_checkpointing(epj_model *m, bool on)
{
	if (m->layout == EPJ_LAYOUT_ROOT) {
		m->root->checkpoint = on;
		return;
	}
	epj_module *layers =
	    ej_module_child(ej_module_child(m->root, "model"), "layers");
	for (int i = 0; i < layers->n_children; i++)
		layers->children[i]->checkpoint = on;
}

/* ---- module tree, public
 * ------------------------------------------------------- */

const char *epj_module_name(const epj_module *m)
{
	return m->name;
}

const char *epj_module_kind(const epj_module *m)
{
	return m->kind;
}

int epj_module_num_children(const epj_module *m)
{
	return m->n_children;
}

epj_module *epj_module_child_at(const epj_module *m, int i)
{
	return i >= 0 && i < m->n_children ? m->children[i] : NULL;
}

epj_module *epj_module_find(epj_module *root, const char *name)
{
	if (!name[0])
		return root;
	epj_module *m = root;
	const char *p = name;
	while (m && *p) {
		const char *dot = strchr(p, '.');
		size_t len = dot ? (size_t)(dot - p) : strlen(p);
		if (len == 0 || (dot && !dot[1]))
			return NULL; /* empty component: "a..b", "a." */
		epj_module *next = NULL;
		for (int i = 0; i < m->n_children; i++) {
			if (strlen(m->children[i]->local) == len &&
			    !strncmp(m->children[i]->local, p, len)) {
				next = m->children[i];
				break;
			}
		}
		m = next;
		p = dot ? dot + 1 : p + len;
	}
	return m;
}

bool epj_module_has_forward(const epj_module *m)
{
	return m->forward != NULL;
}

bool epj_module_compiler_disabled(const epj_module *m)
{
	return m->compiler_disabled;
}

void epj_module_set_checkpoint(epj_module *m, bool on)
{
	m->checkpoint = on;
}

epj_tensor *epj_module_routing(const epj_module *m)
{
	if (!m->compiler_disabled)
		return NULL;
	return ej_autoep_last_routing(m);
}

/* ---- region arguments (offline warm-up) ---------------------------------
 */

epj_status ej_model_region_args(epj_ctx *ctx, const epj_model *model,
				const epj_module *m, int64_t B, int64_t T,
				ej_region_arg *args, int *n_in, int *n_out)
{
	const ej_model_config *c = &model->cfg;
	memset(args, 0, sizeof *args * EJ_REGION_MAX_ARGS);
	/* position and document ids: i64 [B, T] */
	const ej_region_arg ids = { .dtype = EPJ_DTYPE_I64,
				    .ndim = 2,
				    .shape = { B, T } };
	if (m == model->root) {
		/* epj_model_forward_docs: (input_ids, labels[, position_ids]
		 * [, doc_ids]) -> (logits, loss) */
		int n = 0;
		args[n++] = ids;
		args[n++] = ids;
		if (model->docs_pos)
			args[n++] = ids;
		if (model->docs_attn)
			args[n++] = ids;
		*n_in = n;
		*n_out = 2;
		return EPJ_OK;
	}
	if (!strcmp(m->kind, names_of(c)->layer)) {
		/* causal_lm_forward: (h, cos, sin[, doc_ids]) -> h'; h is the
		 * embedding's output (the parameters' dtype), the tables
		 * follow it ([B, 1, T, D] rows of them with position ids) */
		epj_module *root = model->root;
		epj_module *emb = ej_module_child(
		    ej_module_child(root, "model"), "embed_tokens");
		epj_dtype dt = epj_tensor_dtype(ej_module_param(emb, "weight"));
		args[0] = (ej_region_arg){ .dtype = dt,
					   .ndim = 3,
					   .shape = { B, T, c->hidden_size },
					   .activation = true };
		for (int i = 1; i < 3; i++)
			args[i] =
			    model->docs_pos
				? (ej_region_arg){ .dtype = dt,
						   .ndim = 4,
						   .shape = { B, 1, T,
							      rope_dim(c) } }
				: (ej_region_arg){ .dtype = dt,
						   .ndim = 2,
						   .shape = { T,
							      rope_dim(c) } };
		*n_in = 3;
		if (model->docs_attn)
			args[(*n_in)++] = ids;
		*n_out = 1;
		return EPJ_OK;
	}
	return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			"warm-up: the arguments of region \"%s\" (%s) are not "
			"known",
			m->name, m->kind);
}
