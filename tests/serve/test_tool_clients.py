"""Structured-output libraries against the shared app, each pointed at it with ``base_url`` and nothing else changed:
instructor (``Mode.TOOLS``, its default, and ``Mode.JSON_SCHEMA``), langchain-openai (``with_structured_output``
with ``method="function_calling"`` and its default), pydantic-ai (its default tool output and ``NativeOutput``),
litellm (``tools`` and ``response_format``), and smolagents' ``ToolCallingAgent`` running a tool to its answer. Tool
calls ride on ``tools`` / ``tool_choice``
(``deployments/openai/tool_calls.py``), the other modes on ``response_format`` json_schema. Each answer is checked
against its schema with ``jsonschema`` (the libraries validate too: an invalid answer would make them retry or
raise).
"""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.serve


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    population: int = Field(ge=0, le=100_000_000)


SCHEMA = City.model_json_schema()
PROMPT = "Name a big city, its country and population."


def check(value) -> City:
    """``value`` (a City, or its dict) satisfies City's schema."""
    data = value.model_dump() if isinstance(value, BaseModel) else value
    jsonschema.validate(data, SCHEMA)
    return City.model_validate(data)


@pytest.fixture(scope="module")
def base_url(serve_app):
    return f"{serve_app.url}/v1"


@pytest.fixture(scope="module")
def model(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base_url, model, mode):
    import instructor
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused"),
                                    **({} if mode == "TOOLS" else {"mode": instructor.Mode.JSON_SCHEMA}))
    if mode == "TOOLS":
        assert client.mode == instructor.Mode.TOOLS  # the default
    city = client.chat.completions.create(model=model, response_model=City, max_tokens=100, temperature=0,
                                          messages=[{"role": "user", "content": PROMPT}])
    print(f"instructor Mode.{mode}: {city!r}")
    check(city)


@pytest.mark.parametrize("method", ["function_calling", None])
def test_langchain_with_structured_output(base_url, model, method):
    import langchain_openai
    llm = langchain_openai.ChatOpenAI(model=model, base_url=base_url, api_key="unused", max_tokens=100, temperature=0)
    structured = llm.with_structured_output(City, **({"method": method} if method else {}))
    answer = structured.invoke(PROMPT)
    print(f"langchain with_structured_output(method={method!r}): {answer!r}")
    check(answer)
    raw = llm.bind_tools([City], tool_choice="City").invoke(PROMPT)  # the tool call itself, as langchain reads it
    print(f"langchain bind_tools: {raw.tool_calls!r}")
    (call,) = raw.tool_calls
    assert call["name"] == "City" and check(call["args"])


@pytest.mark.parametrize("native", [False, True])
def test_pydantic_ai(base_url, model, native):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat_model = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = Agent(chat_model, output_type=NativeOutput(City) if native else City,
                  model_settings={"max_tokens": 80, "temperature": 0})
    result = agent.run_sync(PROMPT)
    print(f"pydantic-ai {'NativeOutput' if native else 'tool output'}: {result.output!r}")
    check(result.output)


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list at import
    import litellm

    return litellm


def test_litellm_tools(base_url, model, litellm):
    tool = {"type": "function", "function": {"name": "save_city", "description": "Save a city.", "parameters": SCHEMA}}
    r = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="unused", max_tokens=100, temperature=0,
                           messages=[{"role": "user", "content": PROMPT}], tools=[tool], tool_choice="required",
                           parallel_tool_calls=False)
    choice = r.choices[0]
    print(f"litellm tools: {choice.finish_reason} {choice.message.tool_calls!r}")
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        assert call.function.name == "save_city"
        check(json.loads(call.function.arguments))


def test_litellm_response_format(base_url, model, litellm):
    r = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key="unused", max_tokens=100, temperature=0,
                           messages=[{"role": "user", "content": PROMPT}], response_format=City)
    print(f"litellm response_format: {r.choices[0].message.content!r}")
    check(json.loads(r.choices[0].message.content))


def test_smolagents_tool_calling_agent(base_url, model):
    """A ``ToolCallingAgent`` with one ``@tool`` (its ``parameters`` set no ``additionalProperties``) runs its tool:
    smolagents accepts every call (it refuses an argument its tool does not declare, "Argument ... is not in the
    tool's input schema", as an ``AgentToolCallError``), the tool gets a city, and the agent ends with an answer.
    One call per turn (``parallel_tool_calls=False``): the call to the tool comes before the final answer."""
    from smolagents import ActionStep, OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.utils import AgentExecutionError

    cities = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The name of the city.
        """
        cities.append(city)
        return f"The weather in {city} is sunny, 22 degrees."

    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key="unused", max_tokens=120, temperature=0,
                            parallel_tool_calls=False)
    agent = ToolCallingAgent(tools=[get_weather], model=llm, max_steps=3, verbosity_level=0)
    answer = agent.run("What is the weather in Paris? Use the get_weather tool, then give the final answer.")
    steps = [step for step in agent.memory.steps if isinstance(step, ActionStep)]
    for step in steps:
        print(f"smolagents step {step.step_number}: {step.tool_calls!r} error={step.error!r}")
    print(f"smolagents answer: {answer!r}, get_weather got {cities!r}")
    assert not [step.error for step in steps if isinstance(step.error, AgentExecutionError)]  # no call refused
    assert cities and all(isinstance(city, str) and city for city in cities)  # the round trip: the tool ran
    declared = {"get_weather": {"city"}, "final_answer": {"answer"}}
    for step in steps:
        for call in step.tool_calls or []:
            assert set(call.arguments) <= declared[call.name], call
    assert answer is not None
