// Chat: llama.cpp common's chat templates (jinja, common_chat_templates_apply), tool-call and
// reasoning parsing (common_chat_parse), and JSON schema -> GBNF (json_schema_to_grammar).
// Messages and tools cross the boundary as OpenAI-style JSON text, parsed by common's own code.
#include "objects.h"

#include <json-schema-to-grammar.h>
#include <json.h>

#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace lb {

struct ChatTemplates {
    common_chat_templates_ptr t;
    const common_chat_templates * get() const {
        if (!t) raise_value("the chat templates are closed");
        return t.get();
    }
};

static common_json parse_json(const std::string & text, const char * what) {
    try {
        return common_json::parse(text);
    } catch (const std::exception & e) {
        raise_value(std::string(what) + " is not valid JSON: " + e.what());
    }
}

static void templates_init(ChatTemplates * self, Model & model, const std::string & override_template) {
    new (self) ChatTemplates();
    llama_model * m = model.get();
    clear_recent_errors();
    try {
        self->t = common_chat_templates_init(m, override_template);
    } catch (const std::exception & e) {
        raise_value(std::string("cannot parse the chat template: ") + e.what() + "\n" + take_recent_errors());
    }
    if (!self->t) raise_value("cannot parse the chat template\n" + take_recent_errors());
}

// messages_json: OpenAI-style [{"role", "content", "tool_calls"?, ...}]; tools_json: [{"type":
// "function", "function": {...}}] or "". Returns the prompt, grammar and parser to use.
static ChatParams * templates_apply(const ChatTemplates & self, const std::string & messages_json,
                                    const std::string & tools_json, bool add_generation_prompt,
                                    const std::string & json_schema, const std::string & tool_choice,
                                    bool parallel_tool_calls, bool enable_thinking,
                                    const std::map<std::string, std::string> & kwargs) {
    const common_chat_templates * t = self.get();
    common_chat_templates_inputs in;
    try {
        in.messages = common_chat_msgs_parse_oaicompat(parse_json(messages_json, "messages"));
        if (!tools_json.empty()) in.tools = common_chat_tools_parse_oaicompat(parse_json(tools_json, "tools"));
        in.tool_choice = common_chat_tool_choice_parse_oaicompat(tool_choice);
    } catch (const nb::python_error &) {
        throw;
    } catch (const std::exception & e) {
        raise_value(std::string("invalid chat messages or tools: ") + e.what());
    }
    if (in.messages.empty()) raise_value("messages must not be empty");
    if (!json_schema.empty()) {
        parse_json(json_schema, "json_schema");
        in.json_schema = json_schema;
    }
    in.add_generation_prompt = add_generation_prompt;
    in.parallel_tool_calls = parallel_tool_calls;
    in.enable_thinking = enable_thinking;
    in.use_jinja = true;
    for (const auto & [k, v] : kwargs) in.chat_template_kwargs[k] = v;
    auto * out = new ChatParams();
    clear_recent_errors();
    try {
        out->p = common_chat_templates_apply(t, in);
    } catch (const std::exception & e) {
        delete out;
        raise_value(std::string("the chat template failed to render: ") + e.what() + "\n" + take_recent_errors());
    }
    out->from_schema = !json_schema.empty();
    return out;
}

// Parse generated text into an OpenAI-style message (content, reasoning_content, tool_calls), as
// JSON text. is_partial: the text may stop mid-way (streaming).
static std::string chat_parse(const ChatParams & self, const std::string & text, bool is_partial, bool parse_tool_calls,
                              const std::string & reasoning_format) {
    common_chat_parser_params pp(self.p);
    pp.parse_tool_calls = parse_tool_calls;
    try {
        pp.reasoning_format = common_reasoning_format_from_name(reasoning_format);
    } catch (const std::exception & e) {
        raise_value("reasoning_format must be one of none, auto, deepseek, deepseek-legacy; got '" + reasoning_format +
                    "'");
    }
    try {
        if (!self.p.parser.empty()) pp.parser.load(self.p.parser);
        common_chat_msg msg = common_chat_parse(text, is_partial, pp);
        return msg.to_json_oaicompat().dump();
    } catch (const std::exception & e) {
        throw LlamaError(std::string("cannot parse the model's output with the chat format ") +
                         common_chat_format_name(self.p.format) + ": " + e.what());
    }
}

static std::string schema_to_grammar(const std::string & schema) {
    common_json j = parse_json(schema, "the JSON schema");
    if (j.is_object() && j.empty()) j["type"] = "object";  // an empty schema means any object, as llama-server
    try {
        return json_schema_to_grammar(j);
    } catch (const std::exception & e) {
        raise_value(std::string("unsupported JSON schema: ") + e.what());
    }
}

void register_chat(nb::module_ & m) {
    nb::class_<ChatParams>(m, "ChatParams", "A rendered chat prompt and its grammar/parser (common_chat_params).")
        .def_prop_ro("prompt", [](const ChatParams & c) { return c.p.prompt; })
        .def_prop_ro("grammar", [](const ChatParams & c) { return c.p.grammar; })
        .def_prop_ro("grammar_lazy", [](const ChatParams & c) { return c.p.grammar_lazy; })
        .def_prop_ro("format", [](const ChatParams & c) { return std::string(common_chat_format_name(c.p.format)); })
        .def_prop_ro("generation_prompt", [](const ChatParams & c) { return c.p.generation_prompt; })
        .def_prop_ro("additional_stops", [](const ChatParams & c) { return c.p.additional_stops; })
        .def_prop_ro("supports_thinking", [](const ChatParams & c) { return c.p.supports_thinking; })
        .def("parse", &chat_parse, nb::arg("text"), nb::arg("is_partial") = false, nb::arg("parse_tool_calls") = true,
             nb::arg("reasoning_format") = "auto", "Generated text -> OpenAI-style message JSON (common_chat_parse).");
    nb::class_<ChatTemplates>(m, "ChatTemplates", "A model's chat templates (common_chat_templates_init).")
        .def("__init__", &templates_init, nb::arg("model"), nb::arg("override_template") = "",
             "override_template: a jinja template (or a built-in name) used instead of the GGUF's. Raises ValueError.")
        .def("apply", &templates_apply, nb::arg("messages_json"), nb::arg("tools_json") = "",
             nb::arg("add_generation_prompt") = true, nb::arg("json_schema") = "", nb::arg("tool_choice") = "auto",
             nb::arg("parallel_tool_calls") = false, nb::arg("enable_thinking") = true,
             nb::arg("kwargs") = std::map<std::string, std::string>(), nb::rv_policy::take_ownership,
             "Render messages (common_chat_templates_apply). Raises ValueError.")
        .def_prop_ro("source", [](const ChatTemplates & t) { return common_chat_templates_source(t.get()); })
        .def_prop_ro("was_explicit",
                     [](const ChatTemplates & t) { return common_chat_templates_was_explicit(t.get()); });
    m.def("json_schema_to_grammar", &schema_to_grammar, nb::arg("schema"),
          "JSON schema (JSON text) -> GBNF grammar text (common's json_schema_to_grammar). Raises ValueError.");
}

}  // namespace lb
