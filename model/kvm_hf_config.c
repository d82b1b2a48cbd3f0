/* kvm_hf_config.c: a Hugging Face config.json into kvm_model_config, with the architecture's
 * defaults (transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) and every
 * setting the forward cannot reproduce refused by name. */
#include "model/kvm_hf.h"
#include "model/kvm_json.h"
#include "model/kvm_model.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"

#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define KVM_HF_MAX_DIM (1 << 17)
#define KVM_HF_MAX_LAYERS 1024
#define KVM_HF_MAX_VOCAB (1 << 22)
#define KVM_HF_MAX_SEQ (1 << 24)

enum { HF_LLAMA, HF_MISTRAL, HF_QWEN2, HF_QWEN3 };
static const char *const arch_names[] = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                         "Qwen3ForCausalLM"};
/* the model_type of each (transformers' LlamaConfig.model_type, ...) */
static const char *const model_types[] = {"llama", "mistral", "qwen2", "qwen3"};

/* Integer key in [lo, hi]; def used when absent or null and def >= lo (else required). */
static int get_int(const char *f, const json_t *o, const char *key, int64_t def, int64_t lo, int64_t hi, int *out)
{
    const json_t *v = json_object_get(o, key);
    int64_t x = def;
    if (!v || json_is_null(v)) {
        if (def < lo) return kvm_err(KVM_EFORMAT, "%s: key '%s' is missing", f, key);
    } else if (!json_is_integer(v)) {
        return kvm_err(KVM_EFORMAT, "%s: key '%s' is not an integer", f, key);
    } else {
        x = json_integer_value(v);
    }
    if (x < lo || x > hi)
        return kvm_err(KVM_EFORMAT, "%s: key '%s' = %lld is outside [%lld, %lld]", f, key, (long long)x, (long long)lo,
                       (long long)hi);
    *out = (int)x;
    return 0;
}

/* Positive number key that stays positive and finite as a float32 (the forward's type: 1e-300
 * would be 0, 1e300 infinity, and the logits NaN); def when absent or null. */
static int get_num(const char *f, const json_t *o, const char *key, double def, double *out)
{
    const json_t *v = json_object_get(o, key);
    double x = def;
    if (v && !json_is_null(v)) {
        if (!json_is_number(v)) return kvm_err(KVM_EFORMAT, "%s: key '%s' is not a number", f, key);
        x = json_number_value(v);
    } else if (def <= 0) {
        return kvm_err(KVM_EFORMAT, "%s: key '%s' is missing", f, key);
    }
    if (!(x > 0) || !isfinite(x)) return kvm_err(KVM_EFORMAT, "%s: key '%s' = %g must be positive", f, key, x);
    if (x < FLT_MIN || x > FLT_MAX)
        return kvm_err(KVM_EFORMAT, "%s: key '%s' = %g is outside float32's normal range [%g, %g]", f, key, x,
                       (double)FLT_MIN, (double)FLT_MAX);
    *out = x;
    return 0;
}

/* Boolean key; def when absent or null. */
static int get_bool(const char *f, const json_t *o, const char *key, int def, int *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) *out = def;
    else if (json_is_boolean(v)) *out = json_is_true(v);
    else return kvm_err(KVM_EFORMAT, "%s: key '%s' is not a boolean", f, key);
    return 0;
}

/* model_type, when given, names the same architecture as architectures[0] (the class `name`,
 * index arch): transformers' AutoModelForCausalLM builds the model from model_type, so "llama"
 * with Qwen2ForCausalLM would run as Llama there (no QKV biases) and as Qwen2 here, unsaid. */
static int check_model_type(const char *f, const json_t *root, int arch, const char *name)
{
    const json_t *v = json_object_get(root, "model_type");
    if (!v || json_is_null(v)) return 0;
    const char *t = json_string_value(v);
    if (!t) return kvm_err(KVM_EFORMAT, "%s: key 'model_type' is not a string", f);
    if (strcmp(t, model_types[arch]) == 0) return 0;
    return kvm_err(KVM_EFORMAT,
                   "%s: model_type '%.64s' and architectures[0] '%s' disagree (%s is model_type '%s'): which model "
                   "the checkpoint holds is unclear",
                   f, t, name, name, model_types[arch]);
}

static int get_arch(const char *f, const json_t *root, int *arch)
{
    const json_t *a = json_object_get(root, "architectures");
    const char *s = json_string_value(json_array_get(a, 0));
    if (!json_is_array(a) || !s) return kvm_err(KVM_EFORMAT, "%s: key 'architectures' is missing or not a list of names", f);
    for (int i = 0; i < 4; i++)
        if (strcmp(s, arch_names[i]) == 0) {
            *arch = i;
            return check_model_type(f, root, i, s);
        }
    return kvm_err(KVM_ENOTSUP,
                   "%s: architecture '%.64s' is not supported (LlamaForCausalLM, MistralForCausalLM, "
                   "Qwen2ForCausalLM, Qwen3ForCausalLM are)",
                   f, s);
}

/* The rope type of o (`where`) into *t: 'rope_type', else the older 'type', else NULL. Both present and
 * different is refused: transformers 4.x copies 'type' over 'rope_type' (its backward-compatibility step), so
 * reading either one alone could run a scaling other than the one transformers runs. */
static int get_rope_type(const char *f, const json_t *o, const char *where, const char **t)
{
    const char *rt = json_string_value(json_object_get(o, "rope_type"));
    const char *ty = json_string_value(json_object_get(o, "type"));
    if (rt && ty && strcmp(rt, ty) != 0)
        return kvm_err(KVM_EFORMAT,
                       "%s: %s has 'type' '%.32s' and 'rope_type' '%.32s', which disagree (transformers 4 "
                       "copies 'type' over 'rope_type'): remove the wrong one",
                       f, where, ty, rt);
    *t = rt ? rt : ty;
    return 0;
}

/* The rope type of o (rope_scaling or rope_parameters, named `where`) into *rs: "default"
 * (also when o is absent, or has no type and `typed` is 0), or "llama3" with its factors. */
static int get_rope_scaling(const char *f, const json_t *o, const char *where, int typed, kvm_rope_scaling *rs)
{
    *rs = (kvm_rope_scaling){0};
    if (!o || json_is_null(o)) return 0;
    if (!json_is_object(o)) return kvm_err(KVM_EFORMAT, "%s: key '%s' is not an object", f, where);
    const char *t = NULL;
    int trc = get_rope_type(f, o, where, &t);
    if (trc) return trc;
    if (!t && typed) return kvm_err(KVM_EFORMAT, "%s: %s has no 'rope_type'", f, where);
    if (!t || strcmp(t, "default") == 0) return 0;
    if (strcmp(t, "llama3") != 0)
        return kvm_err(KVM_ENOTSUP, "%s: %s type '%.32s' is not supported (llama3 is)", f, where, t);
    double factor, lo, hi;
    int omax;
    int rc;
    if ((rc = get_num(f, o, "factor", -1, &factor)) || (rc = get_num(f, o, "low_freq_factor", -1, &lo)) ||
        (rc = get_num(f, o, "high_freq_factor", -1, &hi)) ||
        (rc = get_int(f, o, "original_max_position_embeddings", -1, 1, KVM_HF_MAX_SEQ, &omax)))
        return kvm_err(rc, "%s (in %s)", kvm_errmsg(), where);
    if (!((float)hi > (float)lo)) /* as float32, which the forward divides by */
        return kvm_err(KVM_EFORMAT, "%s: %s high_freq_factor %g must exceed low_freq_factor %g", f, where, hi, lo);
    *rs = (kvm_rope_scaling){1, (float)factor, (float)lo, (float)hi, omax};
    return 0;
}

/* partial_rotary_factor of o (`where`: "" or " in rope_parameters"): absent, null or 1. */
static int check_partial_rotary(const char *f, const json_t *o, const char *where)
{
    const json_t *prf = json_object_get(o, "partial_rotary_factor");
    if (prf && !json_is_null(prf) && !json_is_number(prf))
        return kvm_err(KVM_EFORMAT, "%s: key 'partial_rotary_factor'%s is not a number", f, where);
    if (prf && !json_is_null(prf) && json_number_value(prf) != 1.0)
        return kvm_err(KVM_ENOTSUP, "%s: partial_rotary_factor = %g%s is not supported", f, json_number_value(prf),
                       where);
    return 0;
}

/* RoPE: rope_theta (default 10000; > 1, kvm__model_check_rope_theta) and rope_scaling, or transformers 5's
 * rope_parameters, which holds rope_type, rope_theta and the factors in one object (read without it, its rope_theta
 * would silently become 10000). rope_parameters per layer type is refused. */
static int get_rope(const char *f, const json_t *root, kvm_model_config *c)
{
    double theta, t2;
    int rc = get_num(f, root, "rope_theta", 10000, &theta);
    const json_t *rp = json_object_get(root, "rope_parameters"), *rs = json_object_get(root, "rope_scaling");
    c->rope_theta = (float)theta;
    if (!rc) rc = kvm__model_check_rope_theta(f, "rope_theta", theta);
    if (rc || !rp || json_is_null(rp)) return rc ? rc : get_rope_scaling(f, rs, "rope_scaling", 1, &c->rope_scaling);
    if (!json_is_object(rp)) return kvm_err(KVM_EFORMAT, "%s: key 'rope_parameters' is not an object", f);
    if (json_is_object(json_object_get(rp, "full_attention")) ||
        json_is_object(json_object_get(rp, "sliding_attention")))
        return kvm_err(KVM_ENOTSUP, "%s: rope_parameters per layer type is not supported", f);
    if ((rc = get_num(f, rp, "rope_theta", theta, &t2)) || (rc = kvm__model_check_rope_theta(f, "rope_theta", t2)))
        return kvm_err(rc, "%s (in rope_parameters)", kvm_errmsg());
    const json_t *top = json_object_get(root, "rope_theta");
    if (top && !json_is_null(top) && t2 != theta)
        return kvm_err(KVM_EFORMAT, "%s: rope_theta = %g and rope_parameters' rope_theta = %g disagree", f, theta, t2);
    c->rope_theta = (float)t2;
    kvm_rope_scaling a;
    if ((rc = check_partial_rotary(f, rp, " in rope_parameters")) ||
        (rc = get_rope_scaling(f, rs, "rope_scaling", 1, &a)) ||
        (rc = get_rope_scaling(f, rp, "rope_parameters", 0, &c->rope_scaling)))
        return rc;
    if (rs && !json_is_null(rs) && memcmp(&a, &c->rope_scaling, sizeof a) != 0)
        return kvm_err(KVM_EFORMAT, "%s: rope_scaling and rope_parameters disagree", f);
    return 0;
}

/* Refuses settings the forward does not implement: activation, MLP biases, quantized weights,
 * partial rotary. */
static int check_unsupported(const char *f, const json_t *root)
{
    const json_t *a = json_object_get(root, "hidden_act");
    const char *act = json_string_value(a);
    if (a && !json_is_null(a) && !act) return kvm_err(KVM_EFORMAT, "%s: key 'hidden_act' is not a string", f);
    if (act && strcmp(act, "silu") != 0)
        return kvm_err(KVM_ENOTSUP, "%s: hidden_act '%.32s' is not supported (silu is)", f, act);
    int mlp_bias = 0; /* get_bool sets it; GCC 12 cannot tell once get_arch grew */
    int rc = get_bool(f, root, "mlp_bias", 0, &mlp_bias);
    if (rc) return rc;
    if (mlp_bias) return kvm_err(KVM_ENOTSUP, "%s: mlp_bias = true is not supported", f);
    const json_t *q = json_object_get(root, "quantization_config"); /* GPTQ, AWQ, bitsandbytes, FP8 */
    if (q && !json_is_null(q)) {
        const char *qm = json_string_value(json_object_get(q, "quant_method"));
        return kvm_err(KVM_ENOTSUP,
                       "%s: quantization_config (quant_method '%.32s') is not supported: kvmill reads "
                       "F32, F16 and BF16 weights",
                       f, qm ? qm : "?");
    }
    return check_partial_rotary(f, root, "");
}

/* e, a JSON value that is no integer, in words ("the float 2", "the string '2'", "a list") into buf. */
static const char *describe_non_integer(const json_t *e, char *buf, size_t size)
{
    if (json_is_real(e))
        snprintf(buf, size, "the float %g", json_real_value(e));
    else if (json_is_string(e))
        snprintf(buf, size, "the string '%.32s'", json_string_value(e));
    else
        snprintf(buf, size, "%s",
                 json_is_array(e)     ? "a list"
                 : json_is_object(e)  ? "an object"
                 : json_is_boolean(e) ? "a boolean"
                                      : "null");
    return buf;
}

/* Entry i of file f's eos_token_id (e; `listed`: v is a list) is no integer: said as such (a float 2.0 or a
 * string "2", which transformers does not take as an id either), not as an id out of range. */
static int eos_not_integer(const char *f, const json_t *e, int listed, size_t i)
{
    char what[64], where[32] = "";
    if (listed) snprintf(where, sizeof where, " entry %zu", i);
    return kvm_err(KVM_EFORMAT, "%s: key 'eos_token_id'%s is %s, not an integer id", f, where,
                   describe_non_integer(e, what, sizeof what));
}

/* Appends the ids of v, file f's eos_token_id (an id or a list of ids, each in [0, vocab)),
 * to c->eos_ids, each once: at most KVM_MODEL_MAX_EOS in all. */
static int add_eos(const char *f, const json_t *v, kvm_model_config *c)
{
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (n < 1) return kvm_err(KVM_EFORMAT, "%s: eos_token_id is an empty list", f);
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_integer(e)) return eos_not_integer(f, e, json_is_array(v), i);
        if (json_integer_value(e) < 0 || json_integer_value(e) >= c->vocab_size)
            return kvm_err(KVM_EFORMAT, "%s: eos_token_id entry %zu is not an id in [0, %d)", f, i, c->vocab_size);
        int32_t id = (int32_t)json_integer_value(e);
        int seen = 0;
        for (int k = 0; k < c->n_eos; k++)
            seen |= c->eos_ids[k] == id;
        if (seen) continue;
        if (c->n_eos == KVM_MODEL_MAX_EOS)
            return kvm_err(KVM_EFORMAT, "%s: eos_token_id makes more than %d end-of-sequence ids", f,
                           KVM_MODEL_MAX_EOS);
        c->eos_ids[c->n_eos++] = id;
    }
    return 0;
}

/* The end-of-sequence ids: config.json's eos_token_id, then those of generation_config.json
 * (gen, file gf; NULL when absent) not already listed. transformers' generate() stops at
 * generation_config.json's, which often lists more (Llama-3 and Qwen2.5 instruct models add
 * their end-of-turn token there) or is the only one to have the key; stopping at the union
 * keeps config.json's too. Either may lack the key; both lacking it is an error. */
static int get_eos(const char *f, const json_t *root, const char *gf, const json_t *gen, kvm_model_config *c)
{
    const json_t *v = json_object_get(root, "eos_token_id"), *g = json_object_get(gen, "eos_token_id");
    int has_v = v && !json_is_null(v), has_g = g && !json_is_null(g), rc;
    if (!has_v && !has_g)
        return kvm_err(KVM_EFORMAT, "%s: key 'eos_token_id' is missing%s%s%s", f, gf ? " (and " : "", gf ? gf : "",
                       gf ? " has none)" : "");
    c->n_eos = 0;
    if ((has_v && (rc = add_eos(f, v, c))) || (has_g && (rc = add_eos(gf, g, c)))) return rc;
    c->eos_id = c->eos_ids[0];
    return 0;
}

/* The shape keys and their consistency. head_dim defaults to hidden_size / num_attention_heads,
 * except for Qwen3, whose configuration class defaults it to 128 whatever the hidden size
 * (transformers' Qwen3Config), so a Qwen3 config.json without the key means 128. */
static int get_shapes(const char *f, const json_t *root, int arch, kvm_model_config *c)
{
    int rc;
    if ((rc = get_int(f, root, "hidden_size", -1, 1, KVM_HF_MAX_DIM, &c->dim)) ||
        (rc = get_int(f, root, "intermediate_size", -1, 1, 8 * KVM_HF_MAX_DIM, &c->hidden_dim)) ||
        (rc = get_int(f, root, "num_hidden_layers", -1, 1, KVM_HF_MAX_LAYERS, &c->n_layers)) ||
        (rc = get_int(f, root, "num_attention_heads", -1, 1, KVM_HF_MAX_DIM, &c->n_heads)) ||
        (rc = get_int(f, root, "num_key_value_heads", c->n_heads, 1, c->n_heads, &c->n_kv_heads)) ||
        (rc = get_int(f, root, "vocab_size", -1, 1, KVM_HF_MAX_VOCAB, &c->vocab_size)) ||
        (rc = get_int(f, root, "max_position_embeddings", -1, 1, KVM_HF_MAX_SEQ, &c->seq_len)))
        return rc;
    if (c->n_heads % c->n_kv_heads)
        return kvm_err(KVM_EFORMAT, "%s: num_attention_heads = %d is not a multiple of num_key_value_heads = %d", f,
                       c->n_heads, c->n_kv_heads);
    int def_hd = arch == HF_QWEN3 ? 128 : c->dim % c->n_heads == 0 ? c->dim / c->n_heads : -1;
    if (def_hd < 0 && !json_object_get(root, "head_dim")) /* it said "key 'head_dim' is missing" */
        return kvm_err(KVM_EFORMAT,
                       "%s: hidden_size = %d is not a multiple of num_attention_heads = %d, and no head_dim is "
                       "given",
                       f, c->dim, c->n_heads);
    if ((rc = get_int(f, root, "head_dim", def_hd, 1, KVM_HF_MAX_DIM, &c->head_dim))) return rc;
    if (c->head_dim % 2) return kvm_err(KVM_EFORMAT, "%s: head_dim = %d is odd; RoPE needs pairs", f, c->head_dim);
    return 0;
}

/* Qwen2's and Qwen3's layers without layer_types, as their configuration classes derive them:
 * layer i slides when use_sliding_window, sliding_window is not null and i ≥ max_window_layers
 * (default 28: the first max_window_layers layers attend fully). Sets *use_sw, *slid (sliding
 * layers: 0, or −1 when sliding_window is absent and takes the class default 4096). */
static int qwen_window(const char *f, const json_t *root, const kvm_model_config *c, int *use_sw, int *slid)
{
    int rc, mwl;
    if ((rc = get_bool(f, root, "use_sliding_window", 0, use_sw)) ||
        (rc = get_int(f, root, "max_window_layers", 28, 0, KVM_HF_MAX_LAYERS, &mwl)))
        return rc;
    const json_t *sw = json_object_get(root, "sliding_window");
    if (sw && json_is_null(sw)) *use_sw = 0; /* None: no layer slides */
    if (*use_sw) *use_sw = c->n_layers > mwl;
    *slid = *use_sw && !sw ? -1 : 0;
    return 0;
}

/* The sliding window: Mistral's sliding_window (absent: 4096, null: none, as MistralConfig
 * reads them), Qwen2's and Qwen3's (qwen_window); where
 * layer_types (transformers 5) names each layer's attention, it decides: all "full_attention"
 * is no window, any "sliding_attention" needs sliding_window. A window mixed with full layers is
 * applied to all: positions past it are then refused (the forward's rule), never computed
 * differently from transformers. */
static int get_window(const char *f, const json_t *root, int arch, kvm_model_config *c)
{
    int use_sw = arch == HF_MISTRAL, rc, sw = 0, slid = 0;
    if ((arch == HF_QWEN2 || arch == HF_QWEN3) && (rc = qwen_window(f, root, c, &use_sw, &slid))) return rc;
    if (arch == HF_MISTRAL && !json_object_get(root, "sliding_window")) slid = -1; /* MistralConfig's 4096 */
    const json_t *lt = json_object_get(root, "layer_types");
    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt) || json_array_size(lt) != (size_t)c->n_layers)
            return kvm_err(KVM_EFORMAT, "%s: key 'layer_types' is not a list of num_hidden_layers = %d names", f,
                           c->n_layers);
        slid = 0; /* the list replaces max_window_layers' rule */
        for (size_t i = 0; i < json_array_size(lt); i++) {
            const char *s = json_string_value(json_array_get(lt, i));
            if (s && strcmp(s, "sliding_attention") == 0)
                slid++;
            else if (!s || strcmp(s, "full_attention") != 0)
                return kvm_err(KVM_ENOTSUP,
                               "%s: layer_types[%zu] = '%.32s' is not supported (full_attention and "
                               "sliding_attention are)",
                               f, i, s ? s : "(not a string)");
        }
        use_sw = slid > 0;
    }
    if (!use_sw) return 0;
    const int def = slid < 0 ? 4096 : slid ? -1 : 0;
    if ((rc = get_int(f, root, "sliding_window", def, slid ? 1 : 0, KVM_HF_MAX_SEQ, &sw))) return rc;
    c->sliding_window = sw >= c->seq_len ? 0 : sw; /* a window at least the context long never slides */
    return 0;
}

/* config.json's root (file f) into c; gen is generation_config.json's (file gf), or NULL. */
static int parse(const char *f, const json_t *root, const char *gf, const json_t *gen, kvm_model_config *c, int *arch,
                 int *tied, int *o_bias)
{
    int rc;
    double eps;
    if (!json_is_object(root)) return kvm_err(KVM_EFORMAT, "%s: not a JSON object", f);
    if ((rc = get_arch(f, root, arch)) || (rc = check_unsupported(f, root)) || (rc = get_shapes(f, root, *arch, c)) ||
        (rc = get_num(f, root, "rms_norm_eps", 1e-6, &eps)) || (rc = get_rope(f, root, c)) ||
        (rc = get_bool(f, root, "tie_word_embeddings", 0, tied)) || (rc = get_eos(f, root, gf, gen, c)) ||
        (rc = get_int(f, root, "bos_token_id", c->eos_id, 0, c->vocab_size - 1, &c->bos_id)))
        return rc;
    c->norm_eps = (float)eps;
    c->rope_style = KVM_ROPE_HALF;
    c->shared_classifier = *tied;
    c->qk_norm = *arch == HF_QWEN3;
    int bias = 0;
    if ((rc = get_bool(f, root, "attention_bias", 0, &bias))) return rc;
    c->attn_bias = *arch == HF_QWEN2 || bias;
    *o_bias = *arch != HF_QWEN2 && bias;
    return get_window(f, root, *arch, c);
}

static int from_root(const char *f, json_t *root, const json_error_t *je, const char *gf, const json_t *gen,
                     kvm_model_config *c, char *arch_out, unsigned arch_size, int *tied, int *o_bias)
{
    if (!root) return kvm_err(KVM_EFORMAT, "%s: %s (line %d, column %d)", f, je->text, je->line, je->column);
    *c = (kvm_model_config){0};
    int arch = 0;
    int rc = parse(f, root, gf, gen, c, &arch, tied, o_bias);
    if (!rc) snprintf(arch_out, arch_size, "%s", arch_names[arch]);
    json_decref(root);
    return rc;
}

/* generation_config.json beside the config.json at path: its path into gf[size], its root into
 * *gen (NULL when the folder has none; the caller json_decrefs it). Errors name gf. */
static int load_generation(const char *path, char *gf, size_t size, json_t **gen)
{
    *gen = NULL;
    const char *slash = strrchr(path, '/');
    snprintf(gf, size, "%.*sgeneration_config.json", slash ? (int)(slash - path + 1) : 0, path);
    int rc = kvm_file_check_found(gf); /* a FIFO would block the load; a broken link would lose its stop ids */
    if (rc == KVM_ENOTFOUND) return 0;
    if (rc) return rc;
    json_error_t je;
    if (!(*gen = kvm__json_load_file(gf, JSON_REJECT_DUPLICATES, &je)))
        return kvm_err(KVM_EFORMAT, "%s: %s (line %d, column %d)", gf, je.text, je.line, je.column);
    if (json_is_object(*gen)) return 0;
    json_decref(*gen);
    *gen = NULL;
    return kvm_err(KVM_EFORMAT, "%s: not a JSON object", gf);
}

int kvm__hf_config(const char *path, kvm_model_config *c, char *arch_out, unsigned arch_size, int *tied, int *o_bias)
{
    char gf[4200];
    json_t *gen;
    int rc = load_generation(path, gf, sizeof gf, &gen);
    if (rc) return rc;
    json_error_t je;
    json_t *root = kvm__json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    rc = from_root(path, root, &je, gen ? gf : NULL, gen, c, arch_out, arch_size, tied, o_bias);
    json_decref(gen);
    return rc;
}

int kvm__hf_config_mem(const char *name, const char *json, size_t len, kvm_model_config *c, char *arch_out,
                       unsigned arch_size, int *tied, int *o_bias)
{
    json_error_t je;
    json_t *root = kvm__json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    return from_root(name, root, &je, NULL, NULL, c, arch_out, arch_size, tied, o_bias);
}
